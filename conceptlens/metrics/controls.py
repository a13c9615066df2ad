"""Controls and baselines for ablation studies: what the concepts' effect is compared with.

    random_orthonormal(r, d, g)                   # isotropic: a uniformly random r-dim subspace
    covariance_directions(r, cov, g)              # matched: Gaussian directions with the activations' covariance
    concept_subsets(n_set, k, chosen, n, g)       # matched: k other concepts of the same set
    base_rate_entropy(y_train, y_test)            # log-loss of the class frequencies (nats): a probe's baseline
    majority_accuracy(y_train, y_test)            # accuracy of always guessing the commonest class: chance
    unigram_entropy(targets)                      # next-token loss of the token frequencies (nats)

Isotropic random directions in a residual stream mostly hit directions where the activations
barely vary, so ablating them costs little and any concept looks important. Directions drawn
with the activation covariance, or other concepts of the same set, carry comparable variance.
Pure tensor math.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def random_orthonormal(n: int, d: int, generator: torch.Generator) -> Tensor:
    """(n, d) rows of an orthonormal basis of a uniformly random n-dim subspace (Gaussian + QR)."""
    return _orthonormal_rows(torch.randn(d, n, generator=generator, dtype=torch.float64))


def covariance_directions(n: int, cov: Tensor, generator: torch.Generator) -> Tensor:
    """(n, d) orthonormal rows spanning n Gaussian draws with covariance `cov` `(d, d)`.

    Each draw is Σ^{1/2} g with g ~ N(0, I); a draw's expected variance captured, g^T Σ^2 g /
    g^T Σ g, sits near the variance of the directions the activations actually use.
    """
    evals, evecs = torch.linalg.eigh(cov.double())
    root = evecs * evals.clamp_min(0).sqrt()  # (d, d): root @ root.T = cov
    return _orthonormal_rows(root @ torch.randn(cov.shape[0], n, generator=generator, dtype=torch.float64))


def _orthonormal_rows(columns: Tensor) -> Tensor:
    q, r = torch.linalg.qr(columns)  # columns (d, n)
    return (q * r.diagonal().sign()).T.float()  # sign fix: Haar-distributed, not QR-biased


def concept_subsets(n_set: int, k: int, exclude: list[int], n_controls: int,
                    generator: torch.Generator) -> list[list[int]]:
    """`n_controls` random sets of `k` concept indices out of `n_set`, none of them in `exclude`."""
    others = torch.tensor(sorted(set(range(n_set)) - set(exclude)), dtype=torch.long)
    if len(others) < k:
        raise ValueError(f"concept controls need {k} concepts besides the chosen ones; the set has {len(others)}")
    return [others[torch.randperm(len(others), generator=generator)[:k]].tolist() for _ in range(n_controls)]


class SiteMoments:
    """Streamed mean `(d,)` and covariance `(d, d)` of activation rows `(N, d)`, in float64."""

    def __init__(self) -> None:
        self.n = 0
        self.sum: Tensor | None = None
        self.outer: Tensor | None = None

    def update(self, x: Tensor) -> None:
        x = x.double()
        s, o = x.sum(0), x.T @ x
        if self.sum is None or self.outer is None:
            self.sum, self.outer = s, o
        else:
            self.sum, self.outer = self.sum + s, self.outer + o
        self.n += len(x)

    def _sums(self) -> tuple[Tensor, Tensor]:
        if self.sum is None or self.outer is None:
            raise ValueError("no activation rows yet: call update(x) first")
        return self.sum, self.outer

    @property
    def mean(self) -> Tensor:
        return (self._sums()[0] / self.n).float()

    @property
    def cov(self) -> Tensor:
        total, outer = self._sums()
        mean = total / self.n
        return outer / self.n - torch.outer(mean, mean)


def _frequencies(y: Tensor, n_classes: int) -> Tensor:
    return torch.bincount(y.long(), minlength=n_classes).double() / len(y)


def base_rate_entropy(y_train: Tensor, y_test: Tensor) -> float:
    """Mean log-loss (nats) on `y_test` of predicting the train class frequencies for every example.

    The entropy of the base rates when both splits share them; a probe that does not beat it
    has learnt nothing from its features.
    """
    k = int(max(y_train.max(), y_test.max())) + 1
    p = _frequencies(y_train, k).clamp_min(1e-12)  # a class unseen in train: finite, huge loss
    return float(-(_frequencies(y_test, k) * p.log()).sum())


def binary_entropy(p: Tensor) -> Tensor:
    """H(p) in nats, elementwise: the log-loss of predicting rate p for a label with rate p."""
    p = p.double().clamp(1e-12, 1 - 1e-12)
    return -(p * p.log() + (1 - p) * (1 - p).log())


def majority_accuracy(y_train: Tensor, y_test: Tensor) -> float:
    """Accuracy on `y_test` of always predicting the commonest train class: the chance level."""
    return float((y_test == torch.bincount(y_train.long()).argmax()).double().mean())


def unigram_entropy(targets: Tensor) -> float:
    """Mean next-token loss (nats) of predicting every target `(N,)` by the targets' own frequencies (in-sample,
    so on few tokens it sits below a held-out unigram model's loss: a conservative baseline):
    what a model that ignores the context achieves at best (the "mean predictor" of language modelling)."""
    counts = torch.bincount(targets.long()).double()
    p = counts[counts > 0] / len(targets)
    return float(-(p * p.log()).sum()) if len(targets) else math.nan
