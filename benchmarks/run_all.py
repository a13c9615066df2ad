"""Every benchmark in one run, each ratio printed side by side at the end.

    python benchmarks/run_all.py --quick          # under 10 minutes on 2 CPU cores
    python benchmarks/run_all.py                  # more tokens, more rounds
    python benchmarks/run_all.py --device cuda    # on a GPU machine
    python benchmarks/run_all.py --only kmeans sae

Sections: capture (bare forward vs raw hooks vs lens.capture vs nnsight; stop-early vs a raw
hook that raises at the same block); fit (lens.fit per extractor at block 15 and at the last
block, each vs the capture-only pass to the same site over the same batches: what the user pays
anyway); describe (the description pass vs the same capture-only pass, both sites); kmeans
(StreamingKMeans vs scikit-learn MiniBatchKMeans at k 4096, one pass, and how close it runs
to this machine's GEMM peak); deleuzian (one block's skewness at the default skew_rows and over
the whole reservoir vs the block's k-means step); dtypes (k-means, Deleuzian, VQ and TopK SAE in
bfloat16 vs float32: speed and inertia / FVU); sae (TopK step vs a minimal step vs SAELens); steer (steered
generation vs nnsight); memory (peak memory of a fit at 10x the tokens vs 1x). Captured
rows are cached under $CONCEPTLENS_BENCH_CACHE (default ~/.cache/conceptlens-bench).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import _describe_bench  # noqa: E402
import _math_benches  # noqa: E402
import _model_benches  # noqa: E402
from _suite import Context, machine  # noqa: E402

SECTIONS = {
    "capture": _model_benches.capture,
    "fit": _model_benches.fit_overhead,
    "describe": _describe_bench.describe_overhead,
    "kmeans": _math_benches.kmeans,
    "deleuzian": _math_benches.deleuzian,
    "dtypes": _math_benches.dtypes,
    "sae": _math_benches.sae,
    "steer": _model_benches.steer,
    "memory": _model_benches.memory,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and rounds (< 10 min on 2 cores)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--only", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args()
    ctx = Context(quick=args.quick, device=torch.device(args.device))
    print(f"machine: {machine()}")
    start = time.perf_counter()
    for name in args.only:
        print(f"\n[{name}] {SECTIONS[name].__doc__.splitlines()[0]}", flush=True)
        t = time.perf_counter()
        SECTIONS[name](ctx)
        print(f"  ({time.perf_counter() - t:.0f} s)")
    total = time.perf_counter() - start
    table = _table(ctx, f"{'quick' if args.quick else 'full'} run, device {args.device}, {total:.0f} s; {machine()}")
    print("\n" + table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    return 0


def _table(ctx: Context, title: str) -> str:
    lines = [title, "", "| section | row | measured | ratio | goal |", "|---|---|---|---|---|"]
    for r in ctx.rows:
        ratio = f"{r.ratio:.3f}x {r.reference}" if r.ratio is not None else ""
        lines.append(f"| {r.section} | {r.name} | {r.value} | {ratio} | {r.goal} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
