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


def _seeded_kmeans(centres: torch.Tensor, batch: int):
    """Our StreamingKMeans starting from given centres (no seeding of its own), through its public state."""
    from conceptlens.concepts.kmeans import StreamingKMeans

    k, d = centres.shape
    km = StreamingKMeans(n_concepts=k, batch_size=batch, seed=0)
    state = km.state_dict()
    state.update(d=d, centres=centres.clone(), mass=torch.zeros(k, dtype=torch.float64),
                 idle=torch.zeros(k, dtype=torch.int64))
    km.load_state_dict(state)
    return km


def kmeans(ctx: Context) -> None:
    """k 4096, batch 4096, one pass: seeding and steps timed apart, vs scikit-learn from the same seeds; held-out inertia."""
    from sklearn.cluster import MiniBatchKMeans, kmeans_plusplus

    from conceptlens.concepts.kmeans import StreamingKMeans
    from conceptlens.concepts.kmeans_math import batched_seeds

    k, batch = 4096, 4096
    rows = block15_rows(16 * batch)
    x, held = rows[:14 * batch], rows[14 * batch:]  # 57,344 training rows, 8,192 held out
    n_rows, head = x.shape[0], 3 * batch  # seeding reads the first 3 batches (sklearn's default init_size)
    flops = gemm_flops(ctx.device)
    ctx.add("machine", "fp32 GEMM (4096 x 576) @ (576 x 4096)", f"{flops / 1e9:.1f} GFLOP/s")
    g = torch.Generator().manual_seed(0)

    # Seeding, each its own row: random rows, our batched D^2 seeding (the default at k > 256), k-means++.
    seeds: dict[str, torch.Tensor] = {"random rows": x[torch.randperm(n_rows, generator=g)[:k]]}
    start = time.perf_counter()
    seeds["ours batched D^2"] = x[batched_seeds(x[:head], k, torch.Generator().manual_seed(0))]
    t_batched = time.perf_counter() - start
    start = time.perf_counter()
    pp, _ = kmeans_plusplus(x[:head].numpy(), k, random_state=0)
    t_pp = time.perf_counter() - start
    seeds["sklearn k-means++"] = torch.from_numpy(pp).float()
    ctx.add("kmeans", f"seeding on {head} rows: sklearn kmeans_plusplus", f"{t_pp:.1f} s")
    ctx.add("kmeans", "seeding: ours batched D^2", f"{t_batched:.1f} s", t_pp / t_batched, "k-means++'s speed")

    def ours(c0):
        km = _seeded_kmeans(c0, batch)
        for part in x.split(batch):
            km.update(part)
        return km.centres

    def theirs(c0):
        mb = MiniBatchKMeans(n_clusters=k, init=c0.numpy(), n_init=1, batch_size=batch, random_state=0)
        for part in x.split(batch):
            mb.partial_fit(part.numpy())
        return torch.from_numpy(mb.cluster_centers_).float()

    # One pass of steps from the same seeds: the step itself, like for like.
    for seed_name in ("random rows", "sklearn k-means++"):
        c0 = seeds[seed_name]
        t_ours, c_ours = _timed_call(lambda: ours(c0))
        t_sk, c_sk = _timed_call(lambda: theirs(c0))
        i_ours, i_sk = inertia(held, c_ours), inertia(held, c_sk)
        ctx.add("kmeans", f"steps from {seed_name}: sklearn partial_fit", f"{n_rows / t_sk:.0f} tok/s, inertia {i_sk:.1f}")
        ctx.add("kmeans", f"steps from {seed_name}: StreamingKMeans", f"{n_rows / t_ours:.0f} tok/s, inertia {i_ours:.1f}",
                t_sk / t_ours, "sklearn's speed", ">= 3x")
        ctx.add("kmeans", f"steps from {seed_name}: held-out inertia", f"{i_ours:.1f} vs {i_sk:.1f}", i_ours / i_sk,
                "sklearn's inertia", "<= 1.00x")

    # Each with its own defaults, seeding included: what a user gets from one call.
    def ours_default():
        km = StreamingKMeans(n_concepts=k, batch_size=batch, seed=0)
        for part in x.split(batch):
            km.update(part)
        km.flush()
        return km.centres

    def sklearn_default():
        mb = MiniBatchKMeans(n_clusters=k, batch_size=batch, max_iter=1, random_state=0)
        mb.fit(x.numpy())
        return torch.from_numpy(mb.cluster_centers_).float()

    t_ours, c_ours = _timed_call(ours_default)
    t_sk, c_sk = _timed_call(sklearn_default)
    i_ours, i_sk = inertia(held, c_ours), inertia(held, c_sk)
    ctx.add("kmeans", "defaults, seeding included: sklearn MiniBatchKMeans", f"{n_rows / t_sk:.0f} tok/s, inertia {i_sk:.1f}")
    ctx.add("kmeans", "defaults, seeding included: StreamingKMeans", f"{n_rows / t_ours:.0f} tok/s, inertia {i_ours:.1f}",
            t_sk / t_ours, "sklearn's speed")
    ctx.add("kmeans", "defaults: held-out inertia", f"{i_ours:.1f} vs {i_sk:.1f}", i_ours / i_sk, "sklearn's inertia")
    assign = 2 * n_rows * k * x.shape[1]  # the distance matmul of one pass: the floor of any k-means pass
    ctx.add("kmeans", "StreamingKMeans: assignment FLOP/s (one pass' matmul / wall time)",
            f"{assign / t_ours / 1e9:.1f} GFLOP/s", assign / t_ours / flops, "of the GEMM peak")


def _timed_call(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


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
