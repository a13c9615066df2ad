"""The math of an EMA vector-quantisation codebook: pure functions on tensors.

    counts, sums = ema_update(counts, sums, onehot.sum(0), onehot.T @ x, decay=0.99)
    codes = codes_from_ema(counts, sums, eps=1e-5)      # (K, d)

`VQCodebook` (vq.py) strings these into training steps; they hold no state of their own.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from conceptlens.concepts.kmeans_math import lloyd, squared_distances

InitMethod = Literal["kmeans", "spherical_kmeans", "random"]
INIT_METHODS = ("kmeans", "spherical_kmeans", "random")


def laplace_smooth(counts: Tensor, eps: float, total: Tensor | None = None, n_codes: int | None = None) -> Tensor:
    """Laplace-smoothed counts (K,) -> (K,): n_i = (N_i + eps) / (N + K eps) * N, N = sum N_i.

    The total N is kept and empty codes stay above zero, so sums / counts stays finite.
    `total`, `n_codes`: N and K of the whole codebook when `counts` is one shard of it.
    """
    n = counts.sum() if total is None else total
    return (counts + eps) / (n + (len(counts) if n_codes is None else n_codes) * eps) * n


def ema_update(counts: Tensor, sums: Tensor, batch_counts: Tensor, batch_sums: Tensor,
               decay: float) -> tuple[Tensor, Tensor]:
    """One EMA step of counts (K,) and sums (K, d) towards a batch's counts and sums."""
    return decay * counts + (1 - decay) * batch_counts, decay * sums + (1 - decay) * batch_sums


def codes_from_ema(counts: Tensor, sums: Tensor, eps: float, total: Tensor | None = None,
                   n_codes: int | None = None) -> Tensor:
    """Codes (K, d) = EMA sums (K, d) / Laplace-smoothed EMA counts (K,) (`total`, `n_codes`: see `laplace_smooth`)."""
    return sums / laplace_smooth(counts, eps, total, n_codes)[:, None]


def samples_randomly(k: int, temperature: float, n_codes: int) -> bool:
    """Whether `sample_top_k` draws uniforms (not when it takes the nearest code)."""
    return temperature != 0 and min(k, n_codes) > 1


def sampled_distances(x: Tensor, codes: Tensor, config: Any, shift: Tensor | None = None) -> Tensor:
    """`(N, K)` the distances a codebook's sampling softmax takes (`VQConfig.distance`), which also
    give each row's nearest code: squared, as one matmul (`squared_distances`, whatever the number
    of rows, so a row's distances do not depend on the rows beside it and ranks that split a batch
    draw as one process does); Euclidean as codebooks fitted before that option computed them.
    `shift`: the bfloat16 matmul's shift (`squared_distances`; default the rows' mean)."""
    if config.distance == "squared":
        return squared_distances(x, codes, shift=shift)
    return torch.cdist(x, codes) if x.dtype == torch.float32 else squared_distances(x, codes, shift=shift).sqrt_()


def sample_top_k(dist: Tensor, k: int, temperature: float,
                 generator: torch.Generator | None = None, u: Tensor | None = None) -> Tensor:
    """Draw one code per row among its k nearest, p ∝ exp(-dist / temperature).

    dist: (N, K) distances (a codebook passes its `sampled_distances`) -> (N,) long. temperature 0 or k 1 gives the nearest code. The
    uniforms come from the CPU `generator`, whatever the device of dist, unless given as
    `u` `(N, 1)` (a distributed step's slice of the uniforms of the whole step).
    """
    neg, index = (-dist).topk(min(k, dist.shape[1]), dim=1)          # (N, k), nearest first
    return sample_nearest(neg, index, temperature, generator, u)


def sample_nearest(neg: Tensor, index: Tensor, temperature: float,
                   generator: torch.Generator | None = None, u: Tensor | None = None) -> Tensor:
    """`sample_top_k` given each row's k nearest codes `index` (N, k), nearest first, and
    their negated distances `neg` (N, k) (a sharded codebook merges them from every shard)."""
    if temperature == 0 or index.shape[1] == 1:
        return index[:, 0]
    cdf = torch.softmax(neg / temperature, dim=1).cumsum(1)         # (N, k)
    if u is None:
        u = torch.rand(len(neg), 1, generator=generator, dtype=cdf.dtype)
    u = u.to(neg.device, cdf.dtype)
    choice = (cdf < u).sum(1).clamp(max=index.shape[1] - 1)         # inverse CDF
    return index.gather(1, choice[:, None]).squeeze(1)


def perplexity(counts: Tensor) -> Tensor:
    """exp(entropy) of the distribution counts (K,) / sum: K if uniform, 1 if one code."""
    p = counts / counts.sum()
    return torch.exp(-torch.special.xlogy(p, p).sum())


def fvu_sums(x: Tensor, x_hat: Tensor) -> Tensor:
    """Additive sums for the FVU of x_hat against x, both (N, d): float64 (d + 3,) holding
    [N, sum |x - x_hat|^2, sum |x|^2, sum x (d)]. Sums of batches (or EMAs of them) pool."""
    x64 = x.detach().double()
    head = torch.stack([x64.new_tensor(float(len(x))), (x64 - x_hat.detach().double()).pow(2).sum(),
                        x64.pow(2).sum()])
    return torch.cat([head, x64.sum(0)])


def fvu_from_sums(sums: Tensor) -> float:
    """Fraction of variance unexplained from `fvu_sums`: SSE / sum |x - mean|^2 (nan if none)."""
    n, sse, sq, sx = sums[0], sums[1], sums[2], sums[3:]
    total = sq - sx.dot(sx) / n if n > 0 else sums.new_tensor(0.0)
    return (sse / total).item() if total > 0 else float("nan")


def initial_codes(x: Tensor, k: int, method: InitMethod,
                  generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Initial codes from a sample x (N, d) -> (centres (k, d), labels (N,)).

    "kmeans": k-means++ then Lloyd. "spherical_kmeans": the same on unit vectors (cosine),
    then each centre is rescaled to the mean norm of its members. "random": k distinct tokens.
    """
    if method == "random":
        centres = x[torch.randperm(len(x), generator=generator)[:k].to(x.device)]
        return centres, squared_distances(x, centres).argmin(1)
    spherical = method == "spherical_kmeans"
    data = F.normalize(x, dim=1) if spherical else x
    # the labels are Lloyd's last assignment, to the centres as `_unit` directs them
    centres, _, labels = lloyd(data, torch.ones(len(x), device=x.device), k, generator, spherical=spherical)
    centres = F.normalize(centres, dim=1) if spherical else centres
    if spherical:
        counts = torch.bincount(labels, minlength=k).to(x)
        norms = torch.zeros_like(counts).index_add_(0, labels, x.norm(dim=1)) / counts.clamp(min=1)
        # an empty cluster keeps its direction at the sample's mean norm rather than at 0
        centres = centres * torch.where(counts > 0, norms, x.norm(dim=1).mean())[:, None]
    return centres, labels
