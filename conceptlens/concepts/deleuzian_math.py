"""The math of Deleuzian's streaming mode: reservoir sampling, skewness of projections, oriented differences.

    n_seen = reservoir_update(reservoir, n_seen, x, generator)   # Algorithm R, in place
    g = skewness(reference, directions)                         # (M,) skewness of x @ d over the rows
    diff, w = oriented_differences(block, reference)            # pairs i, i-1; sign(g) d, 1/|g|

Pure functions on tensors (`Deleuzian` in deleuzian.py strings them into a fit).
"""

from __future__ import annotations

import torch
from torch import Tensor


def reservoir_update(reservoir: Tensor, n_seen: int, x: Tensor, generator: torch.Generator) -> int:
    """Algorithm R over the rows of x `(N, d)`, in place on reservoir `(R, d)`; returns the new n_seen.

    Row t (0-based over the whole stream) fills slot t while t < R; later it replaces slot
    j ~ U{0..t} when j < R. Vectorised: when several rows hit one slot, the last one wins,
    exactly as the sequential algorithm.
    """
    size, n = reservoir.shape[0], x.shape[0]
    fill = max(0, min(size - n_seen, n))
    reservoir[n_seen:n_seen + fill] = x[:fill]
    if fill < n:
        t = torch.arange(n_seen + fill, n_seen + n, dtype=torch.float64)
        slot = (torch.rand(n - fill, generator=generator, dtype=torch.float64) * (t + 1)).floor().long()
        hit = slot < size
        rows = torch.arange(fill, n)[hit]
        winner = torch.full((size,), -1, dtype=torch.long).scatter_reduce_(0, slot[hit], rows, "amax")
        filled = winner >= 0
        reservoir[filled.to(reservoir.device)] = x[winner[filled].to(x.device)].to(reservoir.dtype)
    return n_seen + n


def skewness(x: Tensor, directions: Tensor) -> Tensor:
    """Skewness `(M,)` of the projections of rows x `(R, d)` on each direction `(M, d)`.

    g = mean(((p - mean p) / std p)^3) with p = x @ d; it does not depend on |d|, so the
    directions need not be unit. A direction with zero spread gives NaN.
    """
    # Costs O(R M d) for the projections (the matmul: at R = k rows, what a k-means step of
    # the same block costs; the streaming default draws max(k, 256) rows). Around it: the
    # mean is taken off the projections, not the rows (no (R, d) copy), and the second and
    # third moments are summed per chunk of rows, so no (R, M) cube is ever materialised.
    # In bfloat16 (x's dtype) the matmul runs in it; the mean and the moments stay float32.
    # There the rows are centred first (in float32, an (R, d) copy: 1/M of the matmul), so the
    # projections, and the small mean rounding leaves, are rounded on the scale of their spread:
    # a large mean rounded to 8 bits before it is taken off shifts every p, biasing m3 by
    # 3 * shift * m2 (g off by 1.0 on symmetric rows whose mean is 300x their spread).
    low = x.dtype not in (torch.float32, torch.float64)
    directions = directions.to(x.dtype)
    if low:
        xf = x.float()
        x = (xf - xf.mean(0)).to(directions.dtype)
    mean = x.float().mean(0) @ directions.float().T  # (M,)
    m2 = mean.new_zeros(directions.shape[0])
    m3 = mean.new_zeros(directions.shape[0])
    rows = max(1, (1 << 21) // max(directions.shape[0], 1))
    for part in x.split(rows):
        p = torch.addmm(mean.to(x.dtype), part, directions.T, beta=-1.0).float()  # (r, M) centred projections
        p2 = p * p
        m2 += p2.sum(0)
        m3 += p2.mul_(p).sum(0)  # in place: one (r, M) buffer fewer
    var = m2 / x.shape[0]
    return (m3 / x.shape[0]) / var.pow(1.5)


def oriented_differences(block: Tensor, reference: Tensor, skew_weighting: bool = True) -> tuple[Tensor, Tensor]:
    """Differences `(m, d)` of a randomly ordered block `(m, d)` and their weights `(m,)`.

    Row i is paired with row i-1 (cyclically): a derangement in which each row is used once
    on each side. Each difference is flipped so the reference projects on it with positive
    skewness; its weight is 1/|skewness| (0 where that is not finite), or 1 without weighting.
    """
    block = block.float()
    diff = block - block.roll(1, 0)
    g = skewness(reference, diff)
    diff = diff * torch.where(g < 0, -1.0, 1.0)[:, None]
    if not skew_weighting:
        return diff, torch.ones_like(g)
    w = 1.0 / g.abs()
    return diff, torch.where(torch.isfinite(w), w, 0.0)
