"""Fast k-means kernels: nearest centre by chunked fused matmul, and batched D^2 seeding.

    labels, d2 = nearest(x, centres)                 # (N,), (N,): like squared_distances(x, c).min(1)
    idx = batched_seeds(x, k, generator)             # (k,) row indices, D^2 sampling in rounds

Both are written so that a large k runs at matmul speed on any device: the (N, k) score
block is one `addmm` per chunk of rows (|c|^2 - 2 x.c; |x|^2 is added back only to the
minimum), and seeding draws many centres per round, so its cost is a few large matmuls
instead of k small sequential ones, with one host read per round.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_BLOCK = 1 << 22  # score entries per chunk (16 MB in float32)


def nearest(x: Tensor, c: Tensor, c_sq: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(labels (N,), squared distance to the nearest centre (N,)) for x (N, d), c (k, d).

    Low-precision (bfloat16) x and c: the matmul runs in their dtype (accumulating in float32
    inside), |c|^2, |x|^2 and the scores are float32, so only the product x.c is rounded."""
    low = x.dtype != torch.float32
    cf = c.float()
    c_sq = (cf * cf).sum(1) if c_sq is None else c_sq  # (k,) float32
    rows = max(1, _BLOCK // max(c.shape[0], 1))
    labels, best = [], []
    for part in x.split(rows):
        if low:
            scores = torch.mm(part, c.T).float().mul_(-2.0).add_(c_sq)  # (n, k) = |c|^2 - 2 x.c
        else:
            scores = torch.addmm(c_sq, part, c.T, alpha=-2.0)  # (n, k) = |c|^2 - 2 x.c
        value, index = scores.min(1)
        labels.append(index)
        pf = part.float()
        best.append((value + (pf * pf).sum(1)).clamp_min_(0.0))
    if len(labels) == 1:
        return labels[0], best[0]
    return torch.cat(labels), torch.cat(best)


def batched_seeds(x: Tensor, k: int, generator: torch.Generator, weight: Tensor | None = None,
                  rounds: int = 32) -> Tensor:
    """Indices `(k,)` of rows of x `(N, d)` (N >= k) seeded by D^2 sampling in `rounds` rounds.

    The first centre is drawn in proportion to the weights; each round then draws its share
    of the remaining centres at once, without replacement, in proportion to weight times the
    squared distance to the nearest centre chosen so far. With one centre per round this is
    k-means++ (Arthur & Vassilvitskii 2007, without the greedy trials); with many it is the
    oversampling step of k-means|| (Bahmani et al. 2012) drawing exactly k rows, with no
    re-clustering of an oversampled set. O(k N d) work in `rounds` matmuls.
    """
    n = x.shape[0]
    if n < k:
        raise ValueError(f"batched seeding needs at least k={k} rows; got {n}")
    w = torch.ones(n, dtype=torch.float64) if weight is None else weight.detach().double().cpu()
    first = torch.multinomial(w, 1, generator=generator) if w.sum() > 0 else torch.randint(n, (1,), generator=generator)
    chosen = [first]
    taken = torch.zeros(n, dtype=torch.bool)
    taken[first] = True
    _, closest = nearest(x, x[first.to(x.device)])  # (N,)
    per_round = max(1, math.ceil((k - 1) / max(rounds, 1)))
    total = 1
    while total < k:
        m = min(per_round, k - total)
        p = (w * closest.double().cpu()).masked_fill_(taken, 0.0)  # one host read per round
        if int((p > 0).sum()) < m:  # fewer distinct rows with mass than centres wanted: uniform over the rest
            p = (~taken).double()
        pick = torch.multinomial(p, m, replacement=False, generator=generator)
        taken[pick] = True
        chosen.append(pick)
        total += m
        _, d2 = nearest(x, x[pick.to(x.device)])
        closest = torch.minimum(closest, d2)
    return torch.cat(chosen).to(x.device)
