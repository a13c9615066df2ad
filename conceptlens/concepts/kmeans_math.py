"""The math of k-means, pure functions on tensors (`StreamingKMeans` in kmeans.py strings them into a fit).

    labels, d2 = nearest(x, centres)                 # (N,), (N,): like squared_distances(x, c).min(1)
    idx = batched_seeds(x, k, generator)             # (k,) row indices, D^2 sampling in rounds
    idx = kmeans_plusplus(x, k, generator)           # (k,) greedy k-means++
    sums, received = step_statistics(centres, mass, x, weight, labels)   # additive over shards
    centres, mass, received = apply_step(centres, mass, sums, received)  # one weighted mini-batch step
    centres, mass = weighted_lloyd(points, weight, k, generator)         # full weighted k-means (merges)
    centres, mass, labels = lloyd(points, weight, k, generator)          # the same, with its last assignment

The fast kernels are written so that a large k runs at matmul speed on any device: the (N, k)
score block is one `addmm` per chunk of rows (|c|^2 - 2 x.c; |x|^2 is added back only to the
minimum), and batched seeding draws many centres per round, so its cost is a few large
matmuls instead of k small sequential ones, with one host read per round.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

_BLOCK = 1 << 22  # score entries per chunk (16 MB in float32)


def nearest(x: Tensor, c: Tensor, c_sq: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(labels (N,), squared distance to the nearest centre (N,)) for x (N, d), c (k, d).

    Low-precision (bfloat16) x and c: the matmul runs in their dtype (accumulating in float32
    inside), |c|^2, |x|^2 and the scores are float32, so only the product x.c is rounded. It
    is rounded on the scale of |x||c|, so both are first shifted by the rows' mean (in
    float32; distances do not change): a large common mean (a residual stream's) would
    otherwise drown the gaps between centres (inertia 1.5x at a mean 300 on one coordinate).
    The shift depends on the rows alone, so each centre's distance does not depend on which other
    centres are passed: the nearest over shards of the centres is the nearest over all of them."""
    low = x.dtype != torch.float32
    shift = None
    if low and c_sq is None:
        shift = x.mean(0, dtype=torch.float32).to(x.dtype)  # (d,) any common shift will do: one in x's dtype
        c = (c.float() - shift.float()).to(x.dtype)  # (float32 centres are rounded after the shift)
    cf = c.float()
    c_sq = (cf * cf).sum(1) if c_sq is None else c_sq  # (k,) float32
    rows = max(1, _BLOCK // max(c.shape[0], 1))
    labels, best = [], []
    for part in x.split(rows):
        if shift is not None:
            part = part - shift  # rounded once, on the scale of the difference
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


def squared_distances(x: Tensor, c: Tensor, x_sq: Tensor | None = None, c_sq: Tensor | None = None,
                      shift: Tensor | None = None) -> Tensor:
    """Squared Euclidean distances `(N, k)` between rows of x `(N, d)` and c `(k, d)`.

    |x|^2 - 2 x.c + |c|^2 as one matmul (row norms may be passed in when already known);
    clamped at 0 against rounding. Low-precision (bfloat16) x and c: the matmul runs in their
    dtype, the norms and the sum in float32 (the result is float32); without given norms both
    are first shifted by `shift` (d,) (default: the mean of x), in float32, as in `nearest`: a
    caller whose rows are split across ranks passes one every rank has.
    """
    if x.dtype not in (torch.float32, torch.float64) and x_sq is None and c_sq is None:
        shift = (x.detach().mean(0, dtype=torch.float32) if shift is None else shift.float()).to(x.dtype)  # (d,)
        x, c = x - shift, (c.float() - shift.float()).to(x.dtype)  # c rounded after the shift
    xf, cf = x.float(), c.float()
    x_sq = (xf * xf).sum(1) if x_sq is None else x_sq
    c_sq = (cf * cf).sum(1) if c_sq is None else c_sq
    return (x_sq[:, None] - 2.0 * (x @ c.T).float() + c_sq[None]).clamp_min_(0.0)


def mass_weighted_mean(centres: Tensor, mass: Tensor) -> Tensor:
    """(d,) mean of the rows clustered, from centres `(k, d)` that are running means and their
    masses `(k,)` (exact until a centre is reseeded or merged; the fit's mean activation)."""
    return (mass.double() @ centres.double() / mass.double().sum().clamp_min(1e-300)).float()


def kmeans_plusplus(x: Tensor, k: int, generator: torch.Generator, weight: Tensor | None = None) -> Tensor:
    """Indices `(k,)` of rows of x `(N, d)` chosen as initial centres by greedy k-means++.

    Each new centre is the best (lowest weighted potential) of 2 + ln k candidates drawn with
    probability proportional to weight * squared distance to the nearest chosen centre.
    """
    n = x.shape[0]
    w = torch.ones(n, dtype=torch.float64) if weight is None else weight.detach().double().cpu()
    if x.dtype not in (torch.float32, torch.float64):  # centred, as in `squared_distances` (indices do not change)
        x = (x.float() - x.float().mean(0)).to(x.dtype)
    x_sq = (x.float() * x.float()).sum(1)
    trials = 2 + int(math.log(k))

    def draw(p: Tensor, m: int) -> Tensor:
        if not p.sum() > 0:  # every row already is a centre (or has weight 0): pick uniformly
            return torch.randint(n, (m,), generator=generator)
        return torch.multinomial(p, m, replacement=True, generator=generator)

    x_t = x.T.contiguous()  # (d, N): a few rows times it is a row-major matmul, twice as fast as x.T's
    chosen = [int(draw(w, 1))]
    closest = _distances_to_rows(x[chosen], x_t, x_sq[chosen], x_sq)[0]  # (N,)
    for _ in range(1, k):
        cand = draw(w * closest.double().cpu(), trials).to(x.device)
        d2 = torch.minimum(_distances_to_rows(x[cand], x_t, x_sq[cand], x_sq), closest[None])  # (trials, N)
        best = int((d2.double().cpu() * w).sum(1).argmin())
        chosen.append(int(cand[best]))
        closest = d2[best]
    return torch.tensor(chosen, device=x.device)


def _distances_to_rows(c: Tensor, x_t: Tensor, c_sq: Tensor, x_sq: Tensor) -> Tensor:
    """`squared_distances(c, x, c_sq, x_sq)` `(m, N)` from x transposed `(d, N)`, in place on
    one matmul's output: the same sums in the same order, bar the matmul's."""
    out = (c @ x_t).float().mul_(-2.0).add_(c_sq[:, None])  # (m, N) |c|^2 - 2 c.x
    return out.add_(x_sq[None]).clamp_min_(0.0)


def _assign(view: Tensor, view_sq: Tensor, c: Tensor) -> Tensor:
    """`squared_distances(view, c, view_sq).argmin(1)` `(M,)` in chunks of rows whose (rows, k)
    block stays in cache, in place on each chunk's matmul: the same sums, bar the matmul's."""
    if view.dtype not in (torch.float32, torch.float64):  # shifted first (see `squared_distances`)
        return squared_distances(view, c).argmin(1)
    cf = c.float()
    c_sq = (cf * cf).sum(1)  # (k,)
    rows = max(1, (_BLOCK >> 2) // max(c.shape[0], 1))
    labels = [(part @ c.T).float().mul_(-2.0).add_(part_sq[:, None]).add_(c_sq[None]).clamp_min_(0.0).argmin(1)
              for part, part_sq in zip(view.split(rows), view_sq.split(rows))]
    return labels[0] if len(labels) == 1 else torch.cat(labels)


def minibatch_step(centres: Tensor, mass: Tensor, x: Tensor, weight: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One weighted mini-batch update; returns (centres (k, d), mass (k,), received (k,)).

    centres (k, d), mass (k,) float64, x (N, d), weight (N,), labels (N,) nearest-centre index.
    A centre that receives nothing is unchanged.
    """
    sums, received = step_statistics(centres, mass, x, weight, labels)
    return apply_step(centres, mass, sums, received)


def step_statistics(centres: Tensor, mass: Tensor, x: Tensor, weight: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """The additive statistics of one minibatch: per-centre weighted sums (k, d) and weights (k,).

    Statistics of disjoint shards of a batch add up to those of the whole batch, which is
    what a distributed fit all-reduces before `apply_step`.
    """
    sums = torch.zeros_like(centres).index_add_(0, labels, x.to(centres.dtype) * weight[:, None].to(centres.dtype))
    received = torch.zeros_like(mass).index_add_(0, labels, weight.to(mass.dtype))
    return sums, received


def apply_step(centres: Tensor, mass: Tensor, sums: Tensor, received: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Centres moved by a minibatch's `step_statistics`: (centres, mass, received)."""
    k = centres.shape[0]
    new_mass = mass + received
    # c + (sum w x - W c) / (m + W): the increment form keeps float32 precision at large mass.
    rate = torch.where(new_mass > 0, 1.0 / new_mass.clamp_min(1e-300), 0.0).to(centres.dtype)
    centres = centres + (sums - received.to(centres.dtype)[:, None] * centres) * rate[:, None]
    return centres, new_mass, received.reshape(k)


def weighted_lloyd(points: Tensor, weight: Tensor, k: int, generator: torch.Generator, *,
                   spherical: bool = False, max_iter: int = 100) -> tuple[Tensor, Tensor]:
    """Weighted k-means of points `(M, d)` with weights `(M,)` to k centres: (centres, mass).

    Centres are weighted means of their points; with `spherical`, assignment uses directions.
    """
    centres, mass, _ = lloyd(points, weight, k, generator, spherical=spherical, max_iter=max_iter)
    return centres, mass


def lloyd(points: Tensor, weight: Tensor, k: int, generator: torch.Generator, *,
          spherical: bool = False, max_iter: int = 100) -> tuple[Tensor, Tensor, Tensor]:
    """`weighted_lloyd` and each point's nearest centre: (centres (k, d), mass (k,), labels (M,)).

    It stops once an assignment repeats the previous one (the result of every later
    iteration), and returns that assignment as the labels rather than computing it again.
    """
    view = _unit(points) if spherical else points
    vf = view.float()
    view_sq = (vf * vf).sum(1)  # (M,) once, not per iteration
    weighted = points * weight[:, None].to(points.dtype)  # (M, d)
    centres = points[kmeans_plusplus(view, k, generator, weight)]
    labels = None
    for _ in range(max_iter):
        new = _assign(view, view_sq, _unit(centres) if spherical else centres)
        if labels is not None and torch.equal(new, labels):
            break
        labels = new
        mass = torch.zeros(k, dtype=torch.float64, device=points.device).index_add_(0, labels, weight.double())
        sums = torch.zeros_like(centres).index_add_(0, labels, weighted)
        centres = torch.where(mass[:, None] > 0, sums / mass.clamp_min(1e-300)[:, None].to(points.dtype), centres)
    else:  # max_iter=0, or no repeat within max_iter: the labels of the final centres
        new = _assign(view, view_sq, _unit(centres) if spherical else centres)
    labels = new if labels is None else labels  # the mass is that of the last assignment made
    mass = torch.zeros(k, dtype=torch.float64, device=points.device).index_add_(0, labels, weight.double())
    return centres, mass, new


def _unit(x: Tensor) -> Tensor:
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)


def group_means(x: Tensor, group: Tensor) -> Tensor:
    """`(G, d)` mean of the rows of x `(N, d)` in each group `(N,)`, groups in ascending id order."""
    ids, inverse = torch.unique(group, return_inverse=True)
    total = torch.zeros(len(ids), x.shape[1], dtype=torch.float64, device=x.device).index_add_(0, inverse, x.double())
    return (total / torch.bincount(inverse, minlength=len(ids))[:, None]).to(x.dtype)


def unit_rows(x: Tensor, tokens: Any, unit: str) -> Tensor:
    """The rows an extractor of `unit` (`kmeans_config.UNITS`) fits: x `(N, d)` as it is over tokens,
    else the mean of each document's rows (`tokens.doc`, which `fit` passes)."""
    if unit != "document":
        return x
    if tokens is None:
        raise ValueError('unit="document" needs update(x, tokens=...) naming each row\'s document')
    return group_means(x, tokens.doc.to(x.device))
