"""run_all sections on captured rows: StreamingKMeans vs scikit-learn, TopK SAE vs SAELens."""

from __future__ import annotations

import importlib.util
import time

import torch

from _rows import block15_rows
from _suite import Context, gemm_flops, sync, timed


def inertia(x: torch.Tensor, centres: torch.Tensor, chunk: int = 8192) -> float:
    """Mean squared distance of each row to its nearest centre (the same code for every method)."""
    c_sq = (centres * centres).sum(1)
    total = 0.0
    for part in x.split(chunk):
        d2 = (part * part).sum(1, keepdim=True) - 2 * part @ centres.T + c_sq
        total += float(d2.min(1).values.clamp_min(0).double().sum())
    return total / x.shape[0]


def kmeans(ctx: Context) -> None:
    """One pass, batch 4096, k 4096, initialisation included: tokens/s and inertia vs MiniBatchKMeans."""
    from sklearn.cluster import MiniBatchKMeans

    from conceptlens.concepts.kmeans import StreamingKMeans

    k, batch = 4096, 4096
    n_rows = 14 * batch  # 57,344 rows, as in the measurement
    x = block15_rows(n_rows)
    flops = gemm_flops(ctx.device)
    ctx.add("machine", "fp32 GEMM (4096 x 576) @ (576 x 4096)", f"{flops / 1e9:.1f} GFLOP/s")

    def ours():
        km = StreamingKMeans(n_concepts=k, batch_size=batch, seed=0)
        xd = x.to(ctx.device)
        for part in xd.split(batch):
            km.update(part)
        km.flush()
        return km.concept_set().directions.to(ctx.device)

    def sklearn():
        mb = MiniBatchKMeans(n_clusters=k, batch_size=batch, max_iter=1, n_init=1, random_state=0,
                             max_no_improvement=None, tol=0.0, compute_labels=False)
        mb.fit(x.numpy())
        return torch.from_numpy(mb.cluster_centers_).float()

    results = {}
    for name, fn in (("StreamingKMeans", ours), ("sklearn MiniBatchKMeans", sklearn)):
        sync(ctx.device)
        start = time.perf_counter()
        centres = fn()
        sync(ctx.device)
        results[name] = (time.perf_counter() - start, inertia(x.to(ctx.device), centres.to(ctx.device)))
    (t_ours, i_ours), (t_sk, i_sk) = results["StreamingKMeans"], results["sklearn MiniBatchKMeans"]
    ctx.add("kmeans", f"sklearn MiniBatchKMeans k={k}, {n_rows} rows", f"{n_rows / t_sk:.0f} tok/s, {t_sk:.1f} s")
    ctx.add("kmeans", f"StreamingKMeans k={k}: speed", f"{n_rows / t_ours:.0f} tok/s, {t_ours:.1f} s", t_sk / t_ours,
            "sklearn's speed", ">= 3x")
    ctx.add("kmeans", "StreamingKMeans: inertia", f"{i_ours:.1f} vs {i_sk:.1f}", i_ours / i_sk, "sklearn's inertia",
            "<= 1.00x")
    assign = 2 * n_rows * k * x.shape[1]  # the distance matmul of one pass: the floor of any k-means pass
    ctx.add("kmeans", "StreamingKMeans: assignment FLOP/s (one pass' matmul / wall time)",
            f"{assign / t_ours / 1e9:.1f} GFLOP/s", assign / t_ours / flops, "of the GEMM peak")


def sae(ctx: Context) -> None:
    """TopK SAE steps (width 16x, k 32, batch 4096) on the same batches: ours vs minimal vs SAELens."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from sae import SAELens, Minimal, Ours, fvu

    from conceptlens.concepts.sae import TopKSAE

    batch, k, steps = 4096, 32, 5 if ctx.quick else 12
    x = block15_rows(14 * batch)
    batches, held_out = list(x[:-batch].split(batch))[:6], x[-batch:]
    width = 16 * x.shape[1]
    lr = TopKSAE(width=width, k=k).config.learning_rate()
    makers = {"ours (TopKSAE.update)": Ours, "minimal PyTorch TopK step": Minimal}
    if importlib.util.find_spec("sae_lens") is not None:
        makers["SAELens TopKTrainingSAE"] = SAELens
    else:
        print("  sae_lens is not importable: its row is left out")
    impls = {name: make(batches[0], width, k, lr) for name, make in makers.items()}
    seconds = dict.fromkeys(impls, 0.0)
    for step in range(steps):
        for name, impl in impls.items():
            s = timed(lambda: impl.step(batches[step % len(batches)]), ctx.device)
            seconds[name] += s if step else 0.0  # the first step includes initialisation
    tokens = (steps - 1) * batch
    ours = tokens / seconds["ours (TopKSAE.update)"]
    for name, impl in impls.items():
        rate = tokens / seconds[name]
        ctx.add("sae", f"{name}, width {width}", f"{rate:.0f} tok/s, FVU {fvu(held_out, impl.reconstruct(held_out)):.3f}",
                rate / ours, "of ours' speed")


def deleuzian(ctx: Context) -> None:
    """Deleuzian's skewness of one block (m 2048, d 576) vs the k-means step of the block at k 512."""
    from conceptlens.concepts.deleuzian import DeleuzianConfig, skewness
    from conceptlens.concepts.kmeans import step_statistics
    from conceptlens.concepts.kmeans_math import nearest

    k, m = 512, 2048
    x = block15_rows(14 * 4096)[: m + 4096].to(ctx.device)
    block, ref = x[:m], x[m:]
    diff = block - block.roll(1, 0)
    centres = ref[:k].clone()
    mass, w = torch.zeros(k, dtype=torch.float64, device=ctx.device), torch.ones(m, device=ctx.device)

    def kmeans_step():
        labels, _ = nearest(diff, centres)
        step_statistics(centres, mass, diff, w, labels)

    default = DeleuzianConfig(k).rows_for_skewness
    kernels = {"kmeans": kmeans_step, 4096: lambda: skewness(ref[:4096], diff),
               default: lambda: skewness(ref[:default], diff)}
    times = {name: [] for name in kernels}
    for fn in kernels.values():
        fn()  # warm-up
    for _ in range(15 if ctx.quick else 41):  # interleaved rounds (milliseconds each), best of each
        for name, fn in kernels.items():
            times[name].append(timed(fn, ctx.device))
    t_km = min(times["kmeans"])
    ctx.add("deleuzian", f"k-means step of one block, k={k}", f"{t_km * 1e3:.1f} ms", 1.0, "of the k-means step")
    for rows, label in ((4096, "whole reservoir (skew_rows=4096)"), (default, f"default skew_rows={default}")):
        t = min(times[rows])
        ctx.add("deleuzian", f"skewness of one block, {label}", f"{t * 1e3:.1f} ms", t / t_km, "of the k-means step",
                "<= 1.00x" if rows == default else "")


def dtypes(ctx: Context) -> None:
    """Extractors in bfloat16 vs float32 on the same rows: speed and quality (inertia / FVU)."""
    from conceptlens.concepts.deleuzian import Deleuzian
    from conceptlens.concepts.kmeans import StreamingKMeans
    from conceptlens.concepts.sae import TopKSAE
    from conceptlens.concepts.vq import VQCodebook

    x = block15_rows(14 * 4096)
    train, held = x[: 12 * 4096].to(ctx.device), x[12 * 4096:].to(ctx.device)
    steps = 4 if ctx.quick else 12
    makers = {  # (make, rows fed, quality of the fitted extractor on held-out rows)
        "StreamingKMeans k=4096": (lambda dt: StreamingKMeans(4096, batch_size=4096, dtype=dt), train,
                                   lambda e: ("inertia", e.inertia(held) / len(held))),
        "Deleuzian k=512": (lambda dt: Deleuzian(512, dtype=dt), train,
                            lambda e: ("effective rank", _effective_rank(e.centroids))),
        "VQCodebook 512": (lambda dt: VQCodebook(512, batch_size=4096, dtype=dt), train,
                           lambda e: ("FVU", _fvu(held, e.quantize(held)))),
        "TopKSAE 16x, k=32": (lambda dt: TopKSAE(width=16 * x.shape[1], k=32, dtype=dt), train[: (steps + 1) * 4096],
                              lambda e: ("FVU", _fvu(held, e.reconstruct(held)))),
    }
    for name, (make, rows, quality) in makers.items():
        out = {}
        for dt in ("float32", "bfloat16"):  # warm-up: first calls of each dtype's kernels are slow
            warm = make(dt)
            for part in rows[: 5 * 4096].split(4096):
                warm.update(part)
        for dt in ("bfloat16", "float32"):
            ex = make(dt)
            sync(ctx.device)
            start = time.perf_counter()
            for part in rows.split(4096):
                ex.update(part)
            ex.flush()
            sync(ctx.device)
            out[dt] = (time.perf_counter() - start, *quality(ex))
        (t32, label, q32), (t16, _, q16) = out["float32"], out["bfloat16"]
        ctx.add("dtypes", f"{name}: bfloat16 vs float32 speed", f"{t16:.1f} s vs {t32:.1f} s", t32 / t16,
                "float32's speed")
        ctx.add("dtypes", f"{name}: bfloat16 vs float32 {label}", f"{q16:.5g} vs {q32:.5g}", q16 / q32, f"float32's {label}")


def _fvu(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    return float((x - x_hat).pow(2).sum() / (x - x.mean(0)).pow(2).sum())


def _effective_rank(c: torch.Tensor) -> float:
    s = torch.linalg.svdvals(c.double())
    q = s / s.sum()
    return float(torch.exp(-(q * q.clamp_min(1e-300).log()).sum()))
