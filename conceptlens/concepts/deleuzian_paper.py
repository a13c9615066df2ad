"""The pieces of Deleuzian's paper mode: a reservoir of differences, skewness with endpoints, Lloyd at flush.

    store = DifferenceReservoir(size=65536, d=576, seed=0)
    store.add(diff, p_a, p_b)                              # differences and their endpoints' projections
    g = skewness_with_endpoints(reference, diff, p_a, p_b, n_total)
    centres, mass = paper_clusters(store, reference, n_total, k, generator)

The paper's released code (ClementCornet/Deleuzian-Hypothesis, `diffs`) takes every sample once
as the left end of a difference, measures the skewness of each difference's projections over
ALL samples (its own two endpoints included), orients it to positive skew, weights it by 1/|g|
and runs full weighted k-means (k-means++ then Lloyd, up to 300 iterations) on all of them.
Here the differences are kept in a reservoir (all of them while the stream is shorter than
`size`) and clustered at flush; the skewness over all samples is estimated from the
activation reservoir for the other n - 2 samples and computed exactly for the two endpoints,
which matters: for a difference touching an outlier token, the endpoint dominates the third
moment (|g| ~ 23 over all samples vs ~ 0.2 over a reservoir that misses it).
When the stream fits in both reservoirs, the skewness is the paper's exactly.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from conceptlens.concepts.deleuzian_math import reservoir_update
from conceptlens.concepts.kmeans import weighted_lloyd


class PaperFit(NamedTuple):
    """The clusters of a paper-mode flush."""

    centres: Tensor
    """(k, d) weighted means of the oriented differences"""
    mass: Tensor
    """(k,) float64 total weight of each cluster"""


def skewness_with_endpoints(reference: Tensor, diff: Tensor, p_a: Tensor | None, p_b: Tensor | None,
                            n_total: int, exact: bool = False, chunk_elements: int = 1 << 25) -> Tensor:
    """Skewness `(M,)` of p_j = d . x_j over n_total samples, as the released code computes it:
    mean(((p - mean p) / (std_pop p + 1e-20))^3).

    `reference` `(R, d)` stands for the n_total - 2 samples other than each difference's
    endpoints, whose projections `p_a`, `p_b` `(M,)` enter exactly; with `exact` (the reference
    IS every sample, endpoints included) the reference alone is used (`p_a`, `p_b` may be None).
    The `(R, M)` projections are formed in column chunks of about `chunk_elements` entries, so
    memory stays bounded when every sample is kept (R = M = 65536 would otherwise need 34 GB in float64).
    """
    step = max(1, chunk_elements // max(reference.shape[0], 1))
    ref = reference.double()
    cut = (lambda p, i: None if p is None else p[i:i + step])
    parts = [_skewness_chunk(ref, diff[i:i + step], cut(p_a, i), cut(p_b, i), n_total, exact)
             for i in range(0, diff.shape[0], step)]
    return torch.cat(parts) if parts else diff.new_zeros(0, dtype=torch.float64)


def _skewness_chunk(ref: Tensor, diff: Tensor, p_a: Tensor | None, p_b: Tensor | None, n_total: int,
                    exact: bool) -> Tensor:
    P = ref @ diff.double().T  # (R, m)
    if exact:
        mean = P.mean(0)
        c = P - mean
        std = c.pow(2).mean(0).sqrt() + 1e-20
        return (c / std).pow(3).mean(0)
    if p_a is None or p_b is None:
        raise ValueError("skewness_with_endpoints needs the endpoints' projections p_a and p_b unless exact=True")
    R = P.shape[0]
    w = (n_total - 2) / R  # each reference row stands for this many samples
    ends = torch.stack([p_a.double(), p_b.double()])  # (2, m)
    mean = (w * P.sum(0) + ends.sum(0)) / n_total
    c, ce = P - mean, ends - mean
    std = ((w * c.pow(2).sum(0) + ce.pow(2).sum(0)) / n_total).sqrt() + 1e-20
    return (w * (c / std).pow(3).sum(0) + (ce / std).pow(3).sum(0)) / n_total


def orient_and_weight(diff: Tensor, g: Tensor, skew_weighting: bool) -> tuple[Tensor, Tensor]:
    """d <- sign(g) d (sign 0 stays 0, as torch.sign in the released code); w = 1/|g|, NaN/inf -> 0."""
    diff = diff * torch.sign(g).to(diff.dtype)[:, None]
    if not skew_weighting:
        return diff, torch.ones_like(g)
    return diff, torch.nan_to_num(1.0 / g.abs(), nan=0.0, posinf=0.0, neginf=0.0)


class DifferenceReservoir:
    """A uniform sample (Algorithm R) of at most `size` differences with their endpoints' projections."""

    def __init__(self, size: int, seed: int = 0) -> None:
        self.size = size
        self.rows: Tensor | None = None  # (size, d + 2): difference, p_a, p_b
        self.n_seen = 0
        self._gen = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return min(self.n_seen, self.size)

    def add(self, diff: Tensor, p_a: Tensor, p_b: Tensor) -> None:
        rows = torch.cat([diff.float(), p_a.float()[:, None], p_b.float()[:, None]], dim=1)
        if self.rows is None:
            self.rows = rows.new_zeros(self.size, rows.shape[1])
        self.n_seen = reservoir_update(self.rows, self.n_seen, rows, self._gen)

    def content(self) -> tuple[Tensor, Tensor, Tensor]:
        """(differences `(M, d)`, p_a `(M,)`, p_b `(M,)`) held now."""
        if self.rows is None:
            raise ValueError("no differences yet")
        held = self.rows[: len(self)]
        return held[:, :-2], held[:, -2], held[:, -1]

    def merge(self, other: DifferenceReservoir) -> None:
        """Pool with another reservoir in proportion to the differences each has seen."""
        if other.rows is None:
            return
        if self.rows is None:
            self.rows, self.n_seen = other.rows.clone(), other.n_seen
            return
        mine, theirs = self.rows[: len(self)], other.rows[: len(other)].to(self.rows.device)
        total = self.n_seen + other.n_seen
        if len(mine) + len(theirs) <= self.size:
            pooled = torch.cat([mine, theirs])
        else:
            n_mine = min(len(mine), max(self.size - len(theirs), round(self.size * self.n_seen / total)))
            a = torch.randperm(len(mine), generator=self._gen)[:n_mine]
            b = torch.randperm(len(theirs), generator=self._gen)[: self.size - n_mine]
            pooled = torch.cat([mine[a.to(mine.device)], theirs[b.to(mine.device)]])
        self.rows = self.rows.new_zeros(self.size, self.rows.shape[1])
        self.rows[: len(pooled)] = pooled
        self.n_seen = total if len(pooled) == total else max(total, self.size)

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "n_seen": self.n_seen, "generator": self._gen.get_state(),
                "rows": None if self.rows is None else self.rows[: len(self)].clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["size"] != self.size:
            raise ValueError(f"state has size={state['size']}; this reservoir has size={self.size}")
        self.n_seen = state["n_seen"]
        self._gen.set_state(state["generator"])
        self.rows = None
        if state["rows"] is not None:
            self.rows = state["rows"].new_zeros(self.size, state["rows"].shape[1])
            self.rows[: len(state["rows"])] = state["rows"]


def paper_clusters(store: DifferenceReservoir, reference: Tensor, n_total: int, k: int,
                   generator: torch.Generator, skew_weighting: bool = True,
                   max_iter: int = 300) -> tuple[Tensor, Tensor]:
    """Orient, weight and cluster the stored differences: (centres `(k, d)`, mass `(k,)`)."""
    diff, p_a, p_b = store.content()
    if diff.shape[0] < k:
        raise ValueError(f"{diff.shape[0]} differences cannot make {k} clusters; feed at least {k} rows")
    exact = n_total <= reference.shape[0]
    g = skewness_with_endpoints(reference, diff, p_a, p_b, n_total, exact=exact)
    oriented, w = orient_and_weight(diff, g, skew_weighting)
    if not w.sum() > 0:
        w = torch.ones_like(w)
    return weighted_lloyd(oriented, w.to(oriented.dtype), k, generator, max_iter=max_iter)
