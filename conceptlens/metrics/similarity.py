"""Representation similarity between two sites or models, each measure with the group it ignores.

    from conceptlens.metrics.similarity import MEASURES, similarity, group_audit
    similarity(X, Y, "linear_cka")               # X: (N, d_x), Y: (N, d_y), rows = the same inputs
    MEASURES["cca"].invariant_to                 # "affine"
    report = group_audit(X, Y); print(report)    # which measures moved under random group elements

Groups acting on one representation (SPECS.md, 004), nested isometry < similarity < affine:
- isometry: y -> Q y + t (Q orthogonal); similarity: y -> s Q y + t (s > 0); affine: y -> A y + t
  (A invertible).
A measure declared invariant to a group is unchanged (up to rounding) when either input is
moved by any element of it; `group_audit` checks that claim with random elements and reports
what moved. At q/k sites the symmetry is GL(d_head), so only affine-invariant measures are
model properties there (`sites=` warns otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
from torch import Tensor

from conceptlens.metrics.gauge_sites import warn_if_qk

GroupName = Literal["none", "isometry", "similarity", "affine"]
GROUP_ORDER: tuple[GroupName, ...] = ("none", "isometry", "similarity", "affine")


def _centre(x: Tensor) -> Tensor:
    x = x.double()
    return x - x.mean(0)


def _basis(x: Tensor, keep: float | None = None) -> Tensor:
    """Orthonormal basis `(N, r)` of the centred column space (SVCCA: the top directions holding
    `keep` of the variance)."""
    u, s, _ = torch.linalg.svd(_centre(x), full_matrices=False)
    rank = int((s > s[0] * 1e-10).sum()) if s.numel() and s[0] > 0 else 0
    if keep is not None:
        share = (s**2).cumsum(0) / (s**2).sum()
        rank = min(rank, int((share < keep).sum()) + 1)
    return u[:, :rank]


def linear_cka(x: Tensor, y: Tensor) -> float:
    """Linear CKA (Kornblith et al. 2019): |Yc^T Xc|_F^2 / (|Xc^T Xc|_F |Yc^T Yc|_F)."""
    xc, yc = _centre(x), _centre(y)
    return float((yc.T @ xc).square().sum() / ((xc.T @ xc).norm() * (yc.T @ yc).norm()))


def cca(x: Tensor, y: Tensor) -> float:
    """Mean canonical correlation: mean singular value of Ux^T Uy (orthonormal bases of the centred inputs)."""
    return float(torch.linalg.svdvals(_basis(x).T @ _basis(y)).mean())


def svcca(x: Tensor, y: Tensor, keep: float = 0.99) -> float:
    """SVCCA (Raghu et al. 2017): CCA after keeping the top singular directions holding `keep` of the variance."""
    return float(torch.linalg.svdvals(_basis(x, keep).T @ _basis(y, keep)).mean())


def procrustes(x: Tensor, y: Tensor) -> float:
    """Orthogonal Procrustes similarity of the centred, unit-Frobenius inputs: max_Q <X, Y Q> =
    nuclear norm of X^T Y, in [0, 1] (1 - it is half the squared Procrustes distance)."""
    xc, yc = _centre(x), _centre(y)
    xc, yc = xc / xc.norm(), yc / yc.norm()
    return float(torch.linalg.svdvals(xc.T @ yc).sum())


def mutual_knn(x: Tensor, y: Tensor, k: int = 10) -> float:
    """Mean share of each row's k Euclidean nearest neighbours that the two representations agree on."""
    if not 1 <= k < x.shape[0]:
        raise ValueError(f"k must be in 1..N-1={x.shape[0] - 1}; got {k}")

    def neighbours(z: Tensor) -> Tensor:
        d = torch.cdist(z.double(), z.double())
        d.fill_diagonal_(float("inf"))
        return d.topk(k, largest=False).indices  # (N, k)

    nx_, ny_ = neighbours(x), neighbours(y)
    shared = (nx_[:, :, None] == ny_[:, None, :]).any(-1).sum(1)
    return float(shared.double().mean() / k)


@dataclass(frozen=True)
class SimilarityMeasure:
    """A similarity of two representations `(N, d_x)`, `(N, d_y)` and the largest group it ignores."""

    name: str
    fn: Callable[[Tensor, Tensor], float]
    invariant_to: GroupName

    def invariant_under(self, group: GroupName) -> bool:
        return GROUP_ORDER.index(group) <= GROUP_ORDER.index(self.invariant_to)

    def __call__(self, x: Tensor, y: Tensor) -> float:
        return self.fn(x, y)


MEASURES: dict[str, SimilarityMeasure] = {m.name: m for m in (
    SimilarityMeasure("linear_cka", linear_cka, "similarity"),
    SimilarityMeasure("cca", cca, "affine"),
    SimilarityMeasure("svcca", svcca, "similarity"),
    SimilarityMeasure("procrustes", procrustes, "similarity"),
    SimilarityMeasure("mutual_knn", mutual_knn, "similarity"),
)}


def _check(x: Tensor, y: Tensor) -> None:
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y must be (N, d) with the same N (rows = the same inputs); "
                         f"got {tuple(x.shape)} and {tuple(y.shape)}")


def similarity(x: Tensor, y: Tensor, measure: str = "linear_cka", sites: tuple[Any, Any] | None = None) -> float:
    """One measure of `MEASURES` between `x` and `y`; `sites=(site_x, site_y)` warns (GaugeWarning)
    when a measure that is not affine-invariant is computed at a q/k site."""
    if measure not in MEASURES:
        raise ValueError(f"unknown measure {measure!r}; choose from {sorted(MEASURES)}")
    _check(x, y)
    m = MEASURES[measure]
    if not m.invariant_under("affine"):
        for site in sites or ():
            warn_if_qk(site, measure)
    return m(x, y)


def random_element(group: GroupName, d: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """A random (A, t) of `group` on R^d, float64: y -> y A^T + t. Scales and singular values in [1/4, 4]."""
    if group not in GROUP_ORDER[1:]:
        raise ValueError(f"unknown group {group!r}; choose from {list(GROUP_ORDER[1:])}")

    def orthogonal() -> Tensor:
        q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r))

    def scales(n: int) -> Tensor:
        return torch.exp((torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1) * 1.386)  # 1/4..4

    t = torch.randn(d, generator=gen, dtype=torch.float64) * 3
    if group == "isometry":
        return orthogonal(), t
    if group == "similarity":
        return scales(1) * orthogonal(), t
    return orthogonal() @ torch.diag(scales(d)) @ orthogonal(), t


@dataclass
class GroupAuditReport:
    """Largest relative change of each measure under random elements of each group."""

    change: dict[str, dict[GroupName, float]]
    invariant_to: dict[str, GroupName]
    rtol: float

    def moved(self, measure: str, group: GroupName) -> bool:
        return self.change[measure][group] > self.rtol

    @property
    def consistent(self) -> bool:
        """No measure moved under a group it declares invariance to."""
        return not any(self.moved(m, g) for m, row in self.change.items() for g in row
                       if MEASURES[m].invariant_under(g))

    def __str__(self) -> str:
        groups = list(next(iter(self.change.values())))
        lines = [f"{'measure':<12} {'invariant to':<13} " + " ".join(f"{g:>11}" for g in groups)]
        for m, row in self.change.items():
            cells = " ".join(f"{'MOVED' if self.moved(m, g) else 'same':>5} {v:5.0e}" for g, v in row.items())
            lines.append(f"{m:<12} {self.invariant_to[m]:<13} {cells}")
        return "\n".join(lines)


def group_audit(x: Tensor, y: Tensor, measures: list[str] | None = None,
                groups: tuple[GroupName, ...] = ("isometry", "similarity", "affine"),
                trials: int = 3, seed: int = 0, rtol: float = 1e-6) -> GroupAuditReport:
    """Apply `trials` random elements of each group to `y` (and, separately, to `x`) and record the
    largest relative change of each measure. `report.consistent` checks the declared invariances."""
    _check(x, y)
    names = measures or list(MEASURES)
    for name in names:
        if name not in MEASURES:
            raise ValueError(f"unknown measure {name!r}; choose from {sorted(MEASURES)}")
    gen = torch.Generator().manual_seed(seed)
    x, y = x.double(), y.double()
    base = {m: MEASURES[m](x, y) for m in names}
    change = {m: {g: 0.0 for g in groups} for m in names}
    for g in groups:
        for trial in range(trials):
            moved_y = trial % 2 == 0  # alternate which side is transformed
            z = y if moved_y else x
            A, t = random_element(g, z.shape[1], gen)
            z = z @ A.T + t
            for m in names:
                value = MEASURES[m](x, z) if moved_y else MEASURES[m](z, y)
                rel = abs(value - base[m]) / max(abs(base[m]), 1e-12)
                change[m][g] = max(change[m][g], rel)
    return GroupAuditReport(change, {m: MEASURES[m].invariant_to for m in names}, rtol)
