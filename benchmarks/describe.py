"""The description pass vs a bare forward over the same documents, side by side in one run.

    python benchmarks/describe.py [--docs 160] [--batch 16] [--length 128] [--rounds 3] [--warmup 1] [--width 4608]

SmolLM2-135M, BBC News articles spread over the five topics. Rows: the bare model forward
(tokenising included, LM head included) over every batch; the capture-only forward to
blocks.15.resid_out that the pass runs; and `lens.describe` of three sets at that site in one
pass (a TopK SAE of `--width` latents, k-means and Deleuzian-style directions of 512 each;
weights random: the cost does not depend on them), with top-16 windows, histograms,
co-activation, promoted tokens and the finishing step. Prints each as a ratio to the
capture-only forward to the same site (what the user pays anyway; the bare full forward is shown
for context), and the finishing step (neighbours, logit tokens, decoding; once per pass) apart.
Times are medians of interleaved rounds, as wall time and as this process's CPU time (on a
shared machine the CPU time is the steadier of the two; both are printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import print_table  # noqa: E402

import conceptlens  # noqa: E402
from conceptlens import ConceptSet, data, models  # noqa: E402
from conceptlens.batching import encode_batch  # noqa: E402
from conceptlens.describe import run as describe_run  # noqa: E402

SITE = "blocks.15.resid_out"
CLOCKS = {"wall": time.perf_counter, "CPU": time.process_time}


def interleaved(fns: dict, rounds: int, warmup: int = 1) -> dict[str, dict[str, float]]:
    """Median wall and CPU seconds of each function over interleaved rounds (after `warmup` untimed calls each)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, dict[str, list[float]]] = {c: {name: [] for name in fns} for c in CLOCKS}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = {c: clock() for c, clock in CLOCKS.items()}
            fn()
            for c, clock in CLOCKS.items():
                times[c][name].append(clock() - start[c])
    return {c: {name: statistics.median(t) for name, t in per.items()} for c, per in times.items()}


def concept_sets(d: int, width: int, device: str) -> dict[str, ConceptSet]:
    from conceptlens.concepts.sae import TopKSAE

    g = torch.Generator().manual_seed(0)
    sae = TopKSAE(width=width, k=32, batch_size=256, warmup_tokens=256, seed=0)
    sae.update(torch.randn(512, d, generator=g) * 10)
    sae.flush()
    topk = sae.concept_set()
    topk.site = SITE
    return {"topk": topk,
            "kmeans": ConceptSet(torch.randn(512, d, generator=g) * 10, SITE, method="kmeans"),
            "deleuzian": ConceptSet(torch.randn(512, d, generator=g), SITE, method="deleuzian")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=160, help="about 20,000 tokens: the CLI's description budget")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls of each row first")
    parser.add_argument("--width", type=int, default=4608)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    model, tok = models.load("smollm2-135m")
    model.to(args.device)
    texts = data.load("bbc-news", split="all").texts
    texts = texts[:: max(1, len(texts) // args.docs)][: args.docs]
    lens = conceptlens.attach(model, tok)
    sets = concept_sets(model.config.hidden_size, args.width, args.device)
    tokens = sum(int(encode_batch(tok, texts[i:i + args.batch], args.length)["attention_mask"].sum())
                 for i in range(0, len(texts), args.batch))
    finishing: list[float] = []
    plain_finish = describe_run.finish

    def timed_finish(*a, **kw):
        start = {c: clock() for c, clock in CLOCKS.items()}
        out = plain_finish(*a, **kw)
        finishing.append({c: clock() - start[c] for c, clock in CLOCKS.items()})
        return out

    describe_run.finish = timed_finish
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def batches():
        for i in range(0, len(texts), args.batch):
            yield {k: v.to(args.device) for k, v in encode_batch(tok, texts[i:i + args.batch], args.length).items()}

    def bare():
        for batch in batches():
            model(**batch)
        sync()

    def to_site():
        with lens.capture(SITE) as cap:
            for batch in batches():
                cap.forward(**batch)
        sync()

    def describe():
        lens.describe(sets, texts, batch_size=args.batch, max_length=args.length, progress=False)
        sync()

    rows = {"bare forward (full model)": bare, f"capture-only forward to {SITE}": to_site,
            "describe 3 sets (one pass + finish)": describe}
    print(f"SmolLM2-135M fp32 on {args.device}, {len(texts)} documents x <= {args.length} tokens ({tokens} real), "
          f"batch {args.batch}, {torch.get_num_threads()} threads; sets: TopK SAE {args.width}, k-means 512, "
          f"Deleuzian 512")
    with torch.inference_mode():
        measured = interleaved(rows, args.rounds, args.warmup)
    for label, seconds in measured.items():
        n = len(sets)  # finishing steps come in groups of one per set, one group per pass
        finish_s = statistics.median(sum(f[label] for f in finishing[i:i + n]) for i in range(0, len(finishing), n))
        seconds["describe, streaming part only"] = seconds["describe 3 sets (one pass + finish)"] - finish_s
        print_table(f"{label} time over the same documents (median of {args.rounds} interleaved rounds)", seconds,
                    f"capture-only forward to {SITE}", tokens)
        ratio = seconds["describe 3 sets (one pass + finish)"] / seconds[f"capture-only forward to {SITE}"]
        print(f"  description pass / capture-only to the same site ({label}): {ratio:.3f}x (target <= 1.15x); "
              f"finishing step "
              f"{finish_s * 1e3:.0f} ms per pass (3 sets)")


if __name__ == "__main__":
    main()
