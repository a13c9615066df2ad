"""Deleuzian's skewness per block: its cost against the k-means step, and what a smaller reference gives up.

    python benchmarks/deleuzian_skew.py [--rows 57344] [--k 512] [--fits 2] [--threads 2]

On SmolLM2-135M blocks.15.resid_out rows over BBC News (cached by `_rows.block15_rows`):
1. time of one block's skewness (m = 2048 differences, d = 576) over R reference rows against
   the k-means step of the same block at k (nearest centre + statistics);
2. agreement of the weights 1/|g| over a fresh subsample of R' rows with those over the whole
   R = 4096 reservoir (Spearman), the share of differences oriented alike, and as a noise floor
   the same figures for a second, disjoint 4096-row reservoir;
3. whole streaming fits at k with `skew_rows` = 4096 (the old estimator) and the default
   (max(k, 256)): effective rank of the concepts and the mean cosine of matched concepts
   (Hungarian), next to two seeds of the old estimator.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from scipy.optimize import linear_sum_assignment  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

from _rows import block15_rows  # noqa: E402
from conceptlens.concepts.deleuzian import Deleuzian, skewness  # noqa: E402
from conceptlens.concepts.kmeans import step_statistics  # noqa: E402
from conceptlens.concepts.kmeans_math import nearest  # noqa: E402


def best_of(fn, rounds: int = 3) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def effective_rank(c: torch.Tensor) -> float:
    s = torch.linalg.svdvals(c.double())
    q = s / s.sum()
    return float(torch.exp(-(q * q.clamp_min(1e-300).log()).sum()))


def matched_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    ua, ub = torch.nn.functional.normalize(a.double(), dim=1), torch.nn.functional.normalize(b.double(), dim=1)
    cos = (ua @ ub.T).numpy()
    rows, cols = linear_sum_assignment(-cos)
    return float(cos[rows, cols].mean())


def timing(x: torch.Tensor, k: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    block = x[:2048].to(dtype)
    diff = (block.float() - block.float().roll(1, 0)).to(dtype)
    centres = x[torch.randperm(len(x), generator=gen)[:k]].to(dtype)
    mass = torch.zeros(k, dtype=torch.float64)
    w = torch.ones(len(diff))

    def kmeans_step() -> None:
        labels, _ = nearest(diff, centres)
        step_statistics(centres.float(), mass, diff, w, labels)

    t_km = best_of(kmeans_step)
    print(f"  k-means step, k={k}, m=2048, {dtype}: {t_km * 1e3:.1f} ms")
    for r in (4096, 2048, 1024, 512, 256):
        ref = x[2048:2048 + r].to(dtype)
        t = best_of(lambda: skewness(ref, diff))
        print(f"  skewness R={r:5d}, {dtype}: {t * 1e3:7.1f} ms = {t / t_km:.2f}x the k-means step")


def agreement(x: torch.Tensor, blocks: int = 8) -> None:
    gen = torch.Generator().manual_seed(1)
    ref, ref2, rest = x[:4096], x[4096:8192], x[8192:]
    held_out = rest[blocks * 2048:]  # rows no estimate sees: the "population" skewness
    result: dict[str, list[tuple[float, float]]] = {}
    truth: dict[str, list[float]] = {}
    for b in range(blocks):
        block = rest[b * 2048:(b + 1) * 2048]
        diff = block - block.roll(1, 0)
        g = skewness(ref, diff)
        w = (1 / g.abs()).numpy()
        w_true = (1 / skewness(held_out, diff).abs()).numpy()
        truth.setdefault("whole R=4096 reservoir", []).append(float(spearmanr(w_true, w).statistic))
        cases = {"disjoint R=4096 (noise floor)": skewness(ref2, diff)}
        for r in (2048, 1024, 512, 256):
            cases[f"fresh R'={r}"] = skewness(ref[torch.randperm(4096, generator=gen)[:r]], diff)
        cases["R'=512, bfloat16 projections"] = skewness(ref[torch.randperm(4096, generator=gen)[:512]].bfloat16(),
                                                         diff)
        for name, h in cases.items():
            rho = spearmanr(w, (1 / h.abs()).numpy()).statistic
            result.setdefault(name, []).append((float(rho), float((torch.sign(g) == torch.sign(h)).double().mean())))
            truth.setdefault(name, []).append(float(spearmanr(w_true, (1 / h.abs()).numpy()).statistic))
    print(f"  weights 1/|g| against the whole R=4096 reservoir, {blocks} blocks of 2048 differences (mean):")
    for name, values in result.items():
        rho = sum(v[0] for v in values) / len(values)
        sign = sum(v[1] for v in values) / len(values)
        print(f"    {name:32s} Spearman {rho:.3f}, same orientation {sign:.3f}")
    print(f"  the same weights against those over {held_out.shape[0]} held-out rows (Spearman, mean):")
    for name, values in truth.items():
        print(f"    {name:32s} {sum(values) / len(values):.3f}")


def fits(x: torch.Tensor, k: int, seeds: int) -> None:
    runs = {}
    for name, rows, weighted in (("R=4096", 4096, True), ("default", None, True), ("unweighted", None, False)):
        for seed in range(seeds if weighted else 1):
            t = time.perf_counter()
            dz = Deleuzian(k, skew_rows=rows, skew_weighting=weighted, seed=seed)
            for part in x.split(4096):
                dz.update(part)
            dz.flush()
            c = dz.centroids
            runs[(name, seed)] = c
            print(f"  fit {name} seed {seed}: {time.perf_counter() - t:.1f} s, effective rank {effective_rank(c):.1f}")
    base = runs[("R=4096", 0)]
    for key, c in runs.items():
        if key != ("R=4096", 0):
            print(f"  matched cosine {key[0]} seed {key[1]} vs R=4096 seed 0: {matched_cosine(base, c):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=57344)
    parser.add_argument("--k", type=int, default=512)
    parser.add_argument("--fits", type=int, default=2, help="seeds per weighted estimator")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", nargs="+", choices=("timing", "agreement", "fits"),
                        default=("timing", "agreement", "fits"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    x = block15_rows(57344)[: args.rows]
    print(f"{x.shape[0]} rows x {x.shape[1]}, {args.threads} threads, load average {os.getloadavg()[0]:.1f}")
    if "timing" in args.only:
        for dtype in (torch.float32, torch.bfloat16):
            timing(x, args.k, dtype)
    if "agreement" in args.only:
        agreement(x)
    if "fits" in args.only:
        fits(x, args.k, args.fits)


if __name__ == "__main__":
    main()
