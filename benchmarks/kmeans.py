"""StreamingKMeans vs scikit-learn's MiniBatchKMeans (and Lloyd's KMeans) on real activations.

    python benchmarks/kmeans.py [--articles 150] [--max-length 128] [--k 128] [--batch 1024] [--passes 3]

Activations: SmolLM2-135M blocks.15.resid_out over BBC News articles spread over the five
topics (padding, each sequence's first position and tokens above 10x the median norm
dropped). Both mini-batch methods see the same number of passes with the same batch size
and k-means++ starts; inertia is measured on all rows. Prints, per seed, inertia ratios
(ours / MiniBatchKMeans, ours / KMeans n_init=1) and wall-time ratios, then the Deleuzian
effective rank with and without skew weighting.
"""

from __future__ import annotations

import argparse
import time

import torch
from sklearn.cluster import KMeans, MiniBatchKMeans

import conceptlens
from conceptlens import data, models
from conceptlens.concepts.deleuzian import Deleuzian
from conceptlens.concepts.kmeans import StreamingKMeans


def block15(n_articles: int, max_length: int) -> torch.Tensor:
    model, tok = models.load("smollm2-135m")
    texts = data.load("bbc-news", "all").texts
    texts = texts[:: max(1, len(texts) // n_articles)][:n_articles]
    lens = conceptlens.attach(model, tok)
    rows = []
    with torch.inference_mode(), lens.capture("blocks.15.resid_out") as cap:  # stops after block 15
        for i in range(0, len(texts), 8):
            batch = tok(texts[i:i + 8], return_tensors="pt", padding=True, truncation=True, max_length=max_length)
            captured, meta = cap.forward(**batch)
            acts = captured["blocks.15.resid_out"][meta.position > 0]  # the first token is an attention sink
            norms = acts.norm(dim=1)
            rows.append(acts[norms < 10 * norms.median()])
    return torch.cat(rows).clone()


def effective_rank(c: torch.Tensor) -> float:
    s = torch.linalg.svdvals(c.double())
    q = s / s.sum()
    return float(torch.exp(-(q * q.clamp_min(1e-300).log()).sum()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--articles", type=int, default=150)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--k", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    start = time.perf_counter()
    x = block15(args.articles, args.max_length)
    X = x.numpy()
    print(f"{x.shape[0]} tokens x {x.shape[1]} from {args.articles} articles "
          f"({time.perf_counter() - start:.0f} s to capture); k={args.k}, batch={args.batch}, passes={args.passes}")
    for seed in range(args.seeds):
        gen = torch.Generator().manual_seed(seed)
        t = time.perf_counter()
        km = StreamingKMeans(args.k, batch_size=args.batch, init_size=3 * args.batch, seed=seed)
        for _ in range(args.passes):
            km.update(x[torch.randperm(len(x), generator=gen)])
        ours_s = time.perf_counter() - t
        t = time.perf_counter()
        mbk = MiniBatchKMeans(args.k, batch_size=args.batch, max_iter=args.passes, n_init=1, random_state=seed,
                              max_no_improvement=None, tol=0.0).fit(X)
        mbk_s = time.perf_counter() - t
        t = time.perf_counter()
        lloyd = KMeans(args.k, n_init=1, random_state=seed).fit(X)
        lloyd_s = time.perf_counter() - t
        mbk_inertia = float(((X - mbk.cluster_centers_[mbk.predict(X)]) ** 2).sum())
        ours = km.inertia(x)
        print(f"seed {seed}: inertia ours/MiniBatchKMeans {ours / mbk_inertia:.4f}, ours/KMeans {ours / lloyd.inertia_:.4f}"
              f" | time ours {ours_s:.1f} s, MiniBatchKMeans {mbk_s:.1f} s, KMeans {lloyd_s:.1f} s"
              f" | reseeded {km.n_reseeded}")
    for seed in range(args.seeds):
        ranks = {}
        for weighted in (True, False):
            dz = Deleuzian(args.k, reference_size=4096, buffer_size=4 * args.batch, batch_size=args.batch,
                           skew_weighting=weighted, seed=seed)
            for chunk in x.split(4096):
                dz.update(chunk)
            ranks[weighted] = effective_rank(dz.centroids)
        print(f"seed {seed}: Deleuzian effective rank weighted {ranks[True]:.1f}, unweighted {ranks[False]:.1f} "
              f"(ratio {ranks[True] / ranks[False]:.3f})")


if __name__ == "__main__":
    main()
