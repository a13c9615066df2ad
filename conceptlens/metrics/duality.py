"""Probe weights live in the dual space, steering directions in the activation space.

    w = ProbeWeight(probe.coef_[0], site="blocks.5.resid_out")     # a covector: reads x as w . x
    metric = InnerProduct.covariance(X_train)                       # or .identity(d), .learned(M)
    v = probe_to_direction(w, metric)                               # a Direction: x -> x + alpha v.vector

A linear probe's weight w is a covector: it maps an activation x to a number w . x, and under a
change of coordinates x -> A x it transforms as w -> A^-T w, while a direction transforms as
v -> A v (SPECS.md, 004). Turning one into the other needs an inner product <u, v>_M = u^T M v,
which the caller must name: v is the vector with <v, x>_M = w . x for every x, v = M^-1 w.
- identity: v = w (the Euclidean choice; not equivariant under the affine group).
- covariance: M = Sigma^-1 (the Mahalanobis / "causal" inner product), so v = Sigma w, the
  probe's activation pattern; equivariant: under x -> A x it becomes A v.
- learned: any symmetric positive-definite M.
`ProbeWeight` and `Direction` are separate types, neither a Tensor, so one cannot be passed
where the other is meant without an explicit conversion (or explicitly taking `.covector` /
`.vector`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from conceptlens.metrics.gauge_sites import warn_if_qk


def _vector(x: Any, what: str) -> Tensor:
    if isinstance(x, (ProbeWeight, Direction)):
        raise TypeError(f"{what} needs a plain tensor; got a {type(x).__name__}: convert it with "
                        "probe_to_direction / direction_to_probe and an InnerProduct")
    t = torch.as_tensor(x)
    if t.ndim != 1 or t.numel() == 0 or not t.is_floating_point():
        raise ValueError(f"{what} must be a 1-D float tensor; got shape {tuple(t.shape)} dtype {t.dtype}")
    return t


@dataclass(frozen=True)
class ProbeWeight:
    """A covector (an element of V*): the weight of a linear read-out w . x + b."""

    covector: Tensor
    site: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "covector", _vector(self.covector, "ProbeWeight"))

    def read(self, x: Tensor) -> Tensor:
        """w . x for activations `(..., d)`; a pairing of dual and primal, no metric needed."""
        return x @ self.covector.to(x.dtype)


@dataclass(frozen=True)
class Direction:
    """A vector of the activation space V: something to add to x (steering) or move along."""

    vector: Tensor
    site: str | None = None
    metric: str | None = None
    """Name of the inner product that produced it from a probe, if any."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "vector", _vector(self.vector, "Direction"))


@dataclass(frozen=True)
class InnerProduct:
    """<u, v> = u^T M v on the activation space; M `(d, d)` symmetric positive-definite."""

    matrix: Tensor
    name: str

    def __post_init__(self) -> None:
        M = torch.as_tensor(self.matrix, dtype=torch.float64)
        if M.ndim != 2 or M.shape[0] != M.shape[1]:
            raise ValueError(f"an inner product needs a square (d, d) matrix; got shape {tuple(M.shape)}")
        if not torch.allclose(M, M.T, rtol=1e-6, atol=1e-9 * float(M.abs().max().clamp_min(1))):
            raise ValueError("an inner product's matrix must be symmetric")
        if torch.linalg.eigvalsh(M).min() <= 0:
            raise ValueError("an inner product's matrix must be positive-definite")
        object.__setattr__(self, "matrix", M)

    @property
    def dim(self) -> int:
        return self.matrix.shape[0]

    @classmethod
    def identity(cls, d: int, site: Any = None) -> InnerProduct:
        """The Euclidean inner product (at a q/k site: a GaugeWarning, it is not a model property)."""
        warn_if_qk(site, "the Euclidean inner product")
        return cls(torch.eye(d, dtype=torch.float64), "identity")

    @classmethod
    def covariance(cls, x: Tensor, shrinkage: float = 0.0) -> InnerProduct:
        """M = Sigma^-1 with Sigma the activation covariance of `x` `(N, d)`: v = Sigma w, equivariant.
        `shrinkage` > 0 shrinks Sigma towards (tr Sigma / d) I, which makes a singular Sigma (fewer
        rows than d, or a dead coordinate) invertible but is no longer v = Sigma w nor equivariant:
        on a probe weight along low-variance directions the shrink term can outweigh Sigma w."""
        if not 0 <= shrinkage <= 1:
            raise ValueError(f"shrinkage must be in [0, 1]; got {shrinkage}")
        xc = x.double() - x.double().mean(0)
        S = xc.T @ xc / max(x.shape[0] - 1, 1)
        if shrinkage:
            S = (1 - shrinkage) * S + shrinkage * S.trace() / S.shape[0] * torch.eye(S.shape[0], dtype=S.dtype)
        rank = int(torch.linalg.matrix_rank(S))
        if rank < S.shape[0]:
            raise ValueError(f"the covariance of x ({x.shape[0]} rows, d = {S.shape[0]}) has rank {rank}, so it has "
                             "no inverse: give more rows, or shrinkage > 0 (then v is not exactly Sigma w)")
        M = torch.linalg.inv(S)
        return cls((M + M.T) / 2, "covariance")

    @classmethod
    def learned(cls, M: Tensor) -> InnerProduct:
        return cls(M, "learned")

    def __call__(self, u: Direction, v: Direction) -> Tensor:
        return u.vector.double() @ self.matrix @ v.vector.double()


def _same_dim(n: int, metric: InnerProduct) -> None:
    if not isinstance(metric, InnerProduct):
        raise TypeError(f"metric must be an InnerProduct (identity, covariance or learned); got {type(metric).__name__}")
    if n != metric.dim:
        raise ValueError(f"dimension {n} does not match the inner product's {metric.dim}")


def probe_to_direction(probe: ProbeWeight, metric: InnerProduct) -> Direction:
    """The direction v = M^-1 w with <v, x>_M = w . x for every x (raise the index with `metric`)."""
    if not isinstance(probe, ProbeWeight):
        raise TypeError(f"probe must be a ProbeWeight; got {type(probe).__name__}")
    _same_dim(probe.covector.numel(), metric)
    v = torch.linalg.solve(metric.matrix, probe.covector.double())
    return Direction(v.to(probe.covector.dtype), site=probe.site, metric=metric.name)


def direction_to_probe(direction: Direction, metric: InnerProduct) -> ProbeWeight:
    """The covector w = M v (lower the index): w . x = <v, x>_M."""
    if not isinstance(direction, Direction):
        raise TypeError(f"direction must be a Direction; got {type(direction).__name__}")
    _same_dim(direction.vector.numel(), metric)
    w = metric.matrix @ direction.vector.double()
    return ProbeWeight(w.to(direction.vector.dtype), site=direction.site)
