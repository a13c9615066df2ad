"""The GPU benchmark: capture, steering and fit overhead on models of real sizes, in one table.

    python benchmarks/gpu.py                      # on a CUDA machine: real sizes, bf16 (< 8 min on an H100)
    python benchmarks/gpu.py --only smollm2-135m  # one model
    python benchmarks/gpu.py --dry-run            # tiny sizes on the CPU (the test suite runs this)

Needs only torch, transformers and this checkout (no set-up step, no downloads, no corpus):
the models are built from their configs with random weights (the cost of a forward does not
depend on the weights), in bfloat16, and the documents are random token ids read through a
file-free tokenizer. Rows, per model:

- capture: a bare forward, then `lens.capture` of every block's `resid_out` (ratio to the bare
  forward: a capture of every block runs the whole model anyway);
- steer: greedy `generate` with one `Add` at the middle block, against bare `generate`;
- fit: `lens.fit` per extractor at the middle block, against the capture-only pass to the
  same site over the same batches (`lens.fit` with a no-op extractor: what the user pays anyway);
  tokens/s and the peak device memory of each row.

Every hot loop (the timed calls) runs under `torch.cuda.set_sync_debug_mode("error")`
(`--sync-debug warn|off` to relax it): a host synchronisation fails loudly. A row that
synchronises is timed again without the check and marked "syncs" with the first operation
torch named, so one offender does not hide the rest of the table.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


@dataclass(frozen=True)
class ModelSpec:
    family: str
    """transformers config class name"""
    config: dict[str, Any]
    attention: str = "sdpa"
    """what users run: Gemma 2 has no sdpa path in transformers (its logit soft-capping), so eager"""


# Real sizes (SmolLM2-135M, Llama-3.2-1B, Gemma-2-2B), as their released configs give them.
MODELS = {
    "smollm2-135m": ModelSpec("LlamaConfig", dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
        tie_word_embeddings=True)),
    "llama-1b": ModelSpec("LlamaConfig", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        tie_word_embeddings=True)),
    "gemma-2b": ModelSpec("Gemma2Config", dict(
        hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
        query_pre_attn_scalar=256, sliding_window=4096), attention="eager"),
}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)


class RandomTokenizer:
    """File-free tokenizer for the benchmark's documents: each text is its space-separated ids
    (any other word gets a fixed id from its characters)."""

    all_special_ids: list[int] = []

    def __call__(self, texts, truncation=False, max_length=None, **kwargs):
        ids = [[int(w) if w.isdigit() else 3 + sum(map(ord, w)) % 97 for w in t.split()]
               for t in ([texts] if isinstance(texts, str) else texts)]
        if truncation and max_length:
            ids = [row[:max_length] for row in ids]
        return {"input_ids": ids}


def documents(n: int, length: int, vocab: int, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, length), generator=g)
    return [" ".join(map(str, row.tolist())) for row in ids]


def build(name: str, dry_run: bool, device: torch.device, dtype: torch.dtype):
    import transformers

    spec = MODELS[name]
    kwargs = {**spec.config, **(TINY if dry_run else {})}
    if spec.family == "Gemma2Config" and dry_run:
        kwargs.update(head_dim=16, query_pre_attn_scalar=16, sliding_window=64)
    config = getattr(transformers, spec.family)(**kwargs)
    config._attn_implementation = spec.attention
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


class Timer:
    """Best-of-rounds timing with optional sync debugging around the timed call."""

    def __init__(self, device: torch.device, rounds: int, sync_debug: str) -> None:
        self.device, self.rounds, self.sync_debug = device, rounds, sync_debug

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def _debug(self, mode: str):
        if self.device.type != "cuda" or mode == "off":
            yield
            return
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def once(self, fn: Callable[[], object], mode: str) -> float:
        self.sync()
        start = time.perf_counter()
        with self._debug(mode):
            fn()
        self.sync()
        return time.perf_counter() - start

    def best(self, fns: dict[str, Callable[[], object]]) -> tuple[dict[str, float], dict[str, str], dict[str, float]]:
        """Best seconds per function over interleaved rounds, notes of rows that synchronised, peak memory (MB)."""
        notes: dict[str, str] = {}
        peaks: dict[str, float] = {}
        for name, fn in fns.items():  # warm-up, and the sync check, once per row
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            try:
                self.once(fn, self.sync_debug)
            except RuntimeError as err:
                if "synchroniz" not in str(err):
                    raise
                notes[name] = "syncs: " + str(err).strip().splitlines()[0][:80]
                self.once(fn, "off")
            peaks[name] = torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else 0.0
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(self.rounds):
            for name, fn in fns.items():
                times[name].append(self.once(fn, "off" if name in notes else self.sync_debug))
        return {name: min(t) for name, t in times.items()}, notes, peaks


def extractors(d: int, dry_run: bool) -> dict[str, Callable[[], Any]]:
    from conceptlens.concepts.deleuzian import Deleuzian
    from conceptlens.concepts.kmeans import StreamingKMeans
    from conceptlens.concepts.sae import BatchTopKSAE, TopKSAE
    from conceptlens.concepts.vq import VQCodebook

    k = 32 if not dry_run else 4
    n = 4096 if not dry_run else 16

    class Nothing:
        def update(self, x):
            pass

        def state_dict(self):
            return {}

    return {
        "capture-only (no-op extractor)": Nothing,
        f"StreamingKMeans k={n}": lambda: StreamingKMeans(n_concepts=n, batch_size=n),
        f"Deleuzian k={n // 8}": lambda: Deleuzian(n_concepts=n // 8),
        f"TopKSAE width 16x, k={k}": lambda: TopKSAE(width=16 * d, k=k),
        f"BatchTopKSAE width 16x, k={k}": lambda: BatchTopKSAE(width=16 * d, k=k),
        f"VQCodebook {n // 8} codes": lambda: VQCodebook(n_codes=n // 8),
    }


def bench_model(name: str, args: argparse.Namespace, table: list[tuple]) -> None:
    import conceptlens
    from conceptlens.steering import Add

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = build(name, args.dry_run, device, dtype)
    tok = RandomTokenizer()
    lens = conceptlens.attach(model, tok)
    layers, d = model.config.num_hidden_layers, model.config.hidden_size
    middle = f"blocks.{layers // 2}.resid_out"
    timer = Timer(device, args.rounds, args.sync_debug)
    batch_size, length = (2, 16) if args.dry_run else (8, 512)
    docs = documents(batch_size * (2 if args.dry_run else 8), length, model.config.vocab_size)
    tokens = len(docs) * length
    batch = {"input_ids": torch.tensor([[int(w) for w in t.split()] for t in docs[:batch_size]], device=device)}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])

    def add(section, row, s, base, ref, note, peak, n_tok):
        table.append((name, section, row, s, s / base, ref, note, peak, n_tok / s))

    everything = lens.capture([f"blocks.{i}.resid_out" for i in range(layers)], on_batch=lambda a, m: None)

    def captured():
        with everything:
            model(**batch)

    with torch.inference_mode():
        secs, notes, peaks = timer.best({"bare forward": lambda: model(**batch),
                                         f"lens.capture ({layers} resid_out)": captured})
    base = secs["bare forward"]
    for row, s in secs.items():
        add("capture", row, s, base, "of bare forward", notes.get(row, ""), peaks[row], batch["input_ids"].numel())

    prompt = {k: v[:1, :32] for k, v in batch.items()}
    new = 4 if args.dry_run else 32
    gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    vector = torch.randn(d, generator=torch.Generator().manual_seed(0)).to(device)

    def steered():  # raw units: the cost of the edit, not of measuring a unit
        with lens.steer(Add(vector, site=middle)):
            return model.generate(**prompt, **gen)

    with torch.inference_mode():
        secs, notes, peaks = timer.best({"bare generate": lambda: model.generate(**prompt, **gen),
                                         "lens.steer Add (all positions)": steered})
    base = secs["bare generate"]
    for row, s in secs.items():
        add("steer", row, s, base, "of bare generate", notes.get(row, ""), peaks[row], new)

    fns = {row: (lambda make=make: lens.fit({middle: make()}, docs, tokenizer=tok, batch_size=batch_size,
                                            max_length=length, progress=False, dtype="model"))
           for row, make in extractors(d, args.dry_run).items()}
    secs, notes, peaks = timer.best(fns)
    base = secs["capture-only (no-op extractor)"]
    for row, s in secs.items():
        add("fit", f"{row} at {middle}", s, base, "of capture-only to the same site", notes.get(row, ""), peaks[row],
            tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: checks that the script runs")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--only", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sync-debug", default="error", choices=["error", "warn", "off"])
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if args.dry_run:
        args.rounds = min(args.rounds, 1)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device is visible (use --dry-run on a CPU)")
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "CPU"
    print(f"device {args.device} ({name}), torch {torch.__version__}, {args.dtype}, "
          f"{'dry run (tiny sizes)' if args.dry_run else 'real sizes, random weights'}", flush=True)
    start = time.perf_counter()
    table: list[tuple] = []
    for model in args.only:
        t = time.perf_counter()
        bench_model(model, args, table)  # its model is freed on return
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        print(f"  {model}: {time.perf_counter() - t:.0f} s", flush=True)
    print(f"\ntotal {time.perf_counter() - start:.0f} s\n")
    print("| model | section | row | best s | ratio | tok/s | peak MB | note |")
    print("|---|---|---|---|---|---|---|---|")
    for model, section, row, s, ratio, ref, note, peak, rate in table:
        print(f"| {model} | {section} | {row} | {s:.3f} | {ratio:.3f}x {ref} | {rate:.0f} | {peak:.0f} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
