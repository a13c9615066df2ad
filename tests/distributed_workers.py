"""Bodies run in spawned gloo processes by tests/test_distributed.py (not collected: no test_ prefix).

`spawn(fn, world, out_dir, *args)` starts `world` processes that join one gloo group on
localhost and call `fn(comm, out_dir, *args)`; each writes what it returns to
out_dir/rank{r}.pt, or its error to out_dir/rank{r}.err. The parent waits at most `timeout`
seconds and kills what is left, so no test can hang.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import conceptlens
from conceptlens.concepts import StreamingKMeans, TopKSAE, VQCodebook, Deleuzian
from conceptlens.distributed import Comm
from conceptlens.filters import FilterConfig
from conceptlens.metrics.gauge import QueryKeyMoments

CORPUS = [f"document {i}: " + "abcdefghij"[i % 7:] * (1 + i % 5) for i in range(41)]  # odd: uneven shards


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, out_dir: str, args: tuple, timeout_s: float) -> None:
    os.environ.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), CONCEPTLENS_DIST_TIMEOUT=str(timeout_s))
    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        result = fn(Comm(timeout_s=timeout_s), out, *args)
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        (out / f"rank{rank}.err").write_text(f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        os._exit(1)
    dist.destroy_process_group()


def spawn(fn, world: int, out_dir: Path, *args, timeout: float = 240.0, collective_timeout: float = 60.0) -> list:
    """Run fn on `world` gloo ranks; return (exit codes, results or error texts, seconds)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for r in range(world):  # no stale result of an earlier run
        for suffix in (".pt", ".err"):
            (out_dir / f"rank{r}{suffix}").unlink(missing_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, str(out_dir), args, collective_timeout))
             for r in range(world)]
    start = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(1.0, timeout - (time.monotonic() - start)))
    for p in procs:
        if p.is_alive():  # never leave a hung rank behind
            p.kill()
            p.join()
    seconds = time.monotonic() - start
    results = []
    for r in range(world):
        err, res = out_dir / f"rank{r}.err", out_dir / f"rank{r}.pt"
        results.append(err.read_text() if err.exists() else torch.load(res, weights_only=False) if res.exists() else None)
    return [p.exitcode for p in procs], results, seconds


# ---- extractor-level bodies ---------------------------------------------------------------

def global_batches(n_steps: int = 12, d: int = 6, seed: int = 0) -> list[tuple[torch.Tensor, int]]:
    """(global batch, rows that go to rank 0) per step: uneven splits, some with 0 rows on a rank."""
    g = torch.Generator().manual_seed(seed)
    dirs = 3 * torch.randn(5, d, generator=g)
    out = []
    for t in range(n_steps):
        n = 60 + 17 * (t % 4)
        x = (torch.rand(n, 5, generator=g) < 0.3).float() @ dirs + 0.3 * torch.randn(n, d, generator=g)
        cut = [0, n // 3, n, 2 * n // 3][t % 4]
        out.append((x, cut))
    return out


EXACT = {
    "kmeans": lambda: StreamingKMeans(6, init_size=150, reseed_after=0.5, seed=3),
    "kmeans-spherical": lambda: StreamingKMeans(6, spherical=True, init_size=100, seed=1),
    "vq": lambda: VQCodebook(8, init_size=128, top_k=3, temperature=1.0, reseed_after=4, seed=2),
    # bfloat16 compute: per-rank float32 sums, all-reduced, equal one process's
    "kmeans-bf16": lambda: StreamingKMeans(6, init_size=150, reseed_after=0.5, seed=3, dtype="bfloat16"),
    "vq-bf16": lambda: VQCodebook(8, init_size=128, top_k=3, temperature=1.0, reseed_after=4, seed=2,
                                  dtype="bfloat16"),
}


def exact_body(comm: Comm, out: Path) -> dict:
    """Every EXACT extractor fed this rank's part of each global batch; plus DDP SAE steps."""
    results = {}
    batches = global_batches()
    for name, make in EXACT.items():
        ext = make()
        ext.comm = comm
        for x, cut in batches:
            ext.update(x[:cut] if comm.rank == 0 else x[cut:])
        ext.flush()
        results[name] = ext.state_dict()
    sae = sae_for_ddp()
    sae.comm = comm
    for x in sae_batches():
        half = x.shape[0] // 2
        sae.update(x[:half] if comm.rank == 0 else x[half:])
    results["sae"] = {k: v.detach() for k, v in sae.params.items()}
    results["sae_steps"] = sae.stats().steps
    sae = sae_for_ddp(dtype="bfloat16")
    sae.comm = comm
    for x in sae_batches():
        half = x.shape[0] // 2
        sae.update(x[:half] if comm.rank == 0 else x[half:])
    results["sae_bf16"] = {k: v.detach() for k, v in sae.params.items()}
    return results


def sae_for_ddp(batch_size: int = 32, dtype: str = "float32") -> TopKSAE:
    # buffer = batch: each step takes exactly the rows of one update (mixing made deterministic)
    return TopKSAE(width=16, k=4, batch_size=batch_size, buffer_size=batch_size, warmup_tokens=64,
                   b_dec_init="zeros", seed=5, dtype=dtype)


def sae_batches(n: int = 15) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    dirs = torch.randn(12, 8, generator=g)
    return [(torch.rand(64, 12, generator=g) < 0.2).float() @ dirs + 0.1 * torch.randn(64, 8, generator=g)
            for _ in range(n)]


def quality_body(comm: Comm, out: Path, shards: list[torch.Tensor]) -> dict:
    """Deleuzian and an SAE with their mixing buffers on, fed this rank's uneven shard."""
    dz, sae = quality_extractors()
    for ext in (dz, sae):
        ext.comm = comm
    mine = shards[comm.rank].split(100)
    longest = max(len(s.split(100)) for s in shards)
    for i in range(longest):  # a rank out of data feeds empty batches, as the fit does
        x = mine[i] if i < len(mine) else shards[comm.rank][:0]
        dz.update(x)
        sae.update(x)
    dz.flush()
    sae.flush()
    dz.comm = sae.comm = None
    return {"deleuzian": dz.state_dict(), "sae": sae.state_dict()}


def quality_extractors(ranks: int = 2, seed: int = 4) -> tuple[Deleuzian, TopKSAE]:
    """Per-rank SAE batch 100 on 2 ranks; one process takes the global batch, 100 * ranks."""
    return (Deleuzian(6, reference_size=512, buffer_size=400, batch_size=200, seed=seed - 2),
            TopKSAE(width=6, k=3, batch_size=200 // ranks, warmup_tokens=200, lr=1e-2, seed=seed))


# ---- fit-level bodies -------------------------------------------------------------------------

class KillSwitch(StreamingKMeans):
    """A k-means that SIGKILLs its process on the n-th update (a crash, no cleanup)."""

    def __init__(self, *args, kill_after: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kill_after, self.calls = kill_after, 0

    def update(self, x, weight=None):
        self.calls += 1
        if self.kill_after is not None and self.calls == self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        super().update(x, weight)


def fit_extractors(kill_after: int | None = None) -> dict:
    return {"blocks.1.resid_out": KillSwitch(n_concepts=4, init_size=48, seed=1, kill_after=kill_after),
            "blocks.0.mlp_out": TopKSAE(width=16, k=3, batch_size=32, warmup_tokens=32, seed=2),
            ("blocks.1.attn.q", "blocks.1.attn.k"): QueryKeyMoments()}


def fit_body(comm: Comm, out: Path, run_dir: str | None, kill: dict | None = None) -> dict:
    from tests.conftest import CharTokenizer, tiny_model

    kill_after = None if kill is None else kill.get(comm.rank)
    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    extractors = fit_extractors(kill_after)
    report = lens.fit(extractors, CORPUS, batch_size=4, max_length=24, checkpoint_dir=run_dir,
                      checkpoint_every=None if run_dir is None else 300, progress=False,
                      filters=FilterConfig(max_norm_ratio=None), distributed=True)
    return {"states": {str(k): e.state_dict() for k, e in extractors.items()}, "tokens": report.tokens,
            "documents": report.documents, "batches": report.batches, "resumed_from": report.resumed_from}


# ---- a distributed fit equals one process with the global batch --------------------------------

class TokenLog:
    """A token-aware statistic (as the description pass is): it keeps every row's document,
    position and norm, and every batch's token ids, in the order the fit gives them."""

    def __init__(self) -> None:
        self.doc, self.pos, self.norm, self.ids = [], [], [], []

    def update(self, x, tokens) -> None:
        self.doc.append(tokens.doc.cpu())
        self.pos.append(tokens.pos.cpu())
        self.norm.append(x.norm(dim=1))
        self.ids.append(tokens.ids.cpu())

    def state_dict(self) -> dict:
        return {"doc": torch.cat(self.doc), "pos": torch.cat(self.pos), "norm": torch.cat(self.norm),
                "ids": list(self.ids)}


def equal_extractors() -> dict:
    """One of each extractor kind, several at one site; mixing buffers and pairings on; a
    token-aware statistic."""
    from conceptlens.concepts import CLVQTranscoder

    return {"blocks.1.resid_out": {
                "km": StreamingKMeans(4, init_size=200, seed=1),
                "dz": Deleuzian(4, reference_size=64, buffer_size=96, batch_size=48, seed=2),
                "dz-paper": Deleuzian(4, mode="paper", reference_size=256, max_differences=512, max_iter=20,
                                      seed=3),
                "topk": TopKSAE(width=16, k=3, batch_size=32, buffer_size=96, warmup_tokens=32, seed=4),
                "vq": VQCodebook(6, init_size=96, batch_size=64, buffer_size=128, seed=5)},
            "blocks.0.mlp_out": {"tokens": TokenLog()},
            ("blocks.1.attn.q", "blocks.1.attn.k"): QueryKeyMoments(),
            ("blocks.0.resid_out", "blocks.1.resid_out"): CLVQTranscoder(4, hidden=16, batch_size=64, seed=6)}


EQUAL_FILTERS = FilterConfig(max_norm_ratio=1.15, window=64)  # tight enough that the global median matters


def equal_fit(batch_size: int, distributed: bool, run_dir: str | None = None, corpus: list[str] = CORPUS,
              max_tokens: int | None = None) -> dict:
    """The states of `equal_extractors` after a fit of `corpus` (flat: name -> state), its rows and tokens."""
    from tests.conftest import CharTokenizer, tiny_model

    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    extractors = equal_extractors()
    report = lens.fit(extractors, corpus, batch_size=batch_size, max_length=24, progress=False,
                      filters=EQUAL_FILTERS, distributed=distributed, checkpoint_dir=run_dir,
                      checkpoint_every=None if run_dir is None else 400, max_tokens=max_tokens)
    flat = {}
    for key, value in extractors.items():
        for name, ext in (value.items() if isinstance(value, dict) else [(str(key), value)]):
            flat[name] = ext.state_dict()
    return {"states": flat, "rows": report.rows, "tokens": report.tokens, "resumed_from": report.resumed_from}


def equal_body(comm: Comm, out: Path, run_dir: str | None = None, corpus: list[str] = CORPUS,
               max_tokens: int | None = None) -> dict:
    return equal_fit(4, True, run_dir, corpus, max_tokens)


# ---- ranks that run different fits ----------------------------------------------------------------

MISMATCHES = {  # what rank 1 changes -> (model seed, corpus, extractor, fit options) of rank 1
    "documents": dict(corpus=CORPUS[1:] + CORPUS[:1]),
    "model": dict(seed=1),
    "k": dict(k=5),
    "batch_size": dict(batch_size=3),
    "max_tokens": dict(max_tokens=500),
}


def mismatch_body(comm: Comm, out: Path) -> dict:
    """For each entry of MISMATCHES, a fit whose rank 1 differs in that one thing; the message each rank got."""
    from conceptlens.distributed import DistributedError
    from tests.conftest import CharTokenizer, tiny_model

    messages = {}
    for case, change in MISMATCHES.items():
        mine = change if comm.rank == 1 else {}
        lens = conceptlens.attach(tiny_model("llama", seed=mine.get("seed", 0)), CharTokenizer())
        try:
            lens.fit({"blocks.1.resid_out": StreamingKMeans(mine.get("k", 4), seed=1)}, mine.get("corpus", CORPUS),
                     batch_size=mine.get("batch_size", 4), max_tokens=mine.get("max_tokens"), max_length=24,
                     progress=False, distributed=True)
            messages[case] = None
        except DistributedError as err:
            messages[case] = str(err)
    return messages


def lonely_body(out: Path, port: int, timeout_s: float) -> None:
    """Rank 0 of 2 whose rank 1 never starts: lens.fit joins the group itself (no group beforehand)."""
    from tests.conftest import CharTokenizer, tiny_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="2",
                      CONCEPTLENS_DIST_TIMEOUT=str(timeout_s))
    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    try:
        lens.fit({"blocks.1.resid_out": StreamingKMeans(4)}, CORPUS, progress=False, distributed=True)
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        (out / "rank0.err").write_text(f"{type(err).__name__}: {err}")
        os._exit(1)


def die_body(comm: Comm, out: Path, who: int) -> None:
    """Rank `who` exits at once (a crash); the others run one all-reduce."""
    if comm.rank == who:
        os._exit(3)
    comm.sum_(torch.ones(1))
