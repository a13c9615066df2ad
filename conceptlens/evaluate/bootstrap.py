"""95% intervals by a bootstrap over held-out documents.

    est = bootstrap(per_doc, lambda t: t[..., 0] / t[..., 1])    # per_doc: (D, m) sums per document
    est.value, est.low, est.high

Every figure of the suite is a function of sums over documents (a mean loss is the sum of
token losses over the sum of token counts; an accuracy is correct rows over rows). A bootstrap
replicate draws D documents with replacement, i.e. multinomial counts `w` `(D,)`, and evaluates
the statistic on the weighted sums `w @ per_doc`; the interval is the 2.5-97.5 percentile range
over replicates. Pure tensor math.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import torch
from torch import Tensor

DRAWS = 1000
"""Bootstrap replicates per figure."""

Statistic = Callable[[Tensor], Tensor]
"""`(..., m)` summed columns -> `(...)` the figure; it must broadcast over leading dimensions."""


class Estimate(NamedTuple):
    value: float
    """the figure on the held-out documents as they are"""
    low: float
    """2.5th percentile over bootstrap replicates"""
    high: float
    """97.5th percentile"""

    def __str__(self) -> str:
        if math.isnan(self.low):
            return f"{self.value:.4f}"
        return f"{self.value:.4f} [{self.low:.4f}, {self.high:.4f}]"


def document_weights(n_docs: int, draws: int = DRAWS, seed: int = 0) -> Tensor:
    """`(draws, n_docs)` float64 counts: how often each document is drawn in each replicate."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(n_docs, (draws, n_docs), generator=g)
    return torch.zeros(draws, n_docs, dtype=torch.float64).scatter_add_(1, picks, torch.ones_like(picks, dtype=torch.float64))


def bootstrap(per_doc: Tensor, statistic: Statistic, *, draws: int = DRAWS, seed: int = 0) -> Estimate:
    """The statistic of the column sums of `per_doc` `(D, m)`, with its bootstrap interval over documents."""
    per_doc = per_doc.double()
    value = float(statistic(per_doc.sum(0)))
    replicates = statistic(document_weights(len(per_doc), draws, seed) @ per_doc)  # (draws,)
    return _interval(value, replicates)


def bootstrap_draws(per_doc: Sequence[Tensor], statistic: Statistic, *, draws: int = DRAWS,
                    seed: int = 0) -> Estimate:
    """Like `bootstrap` for a control drawn R times (R tensors `(D, m)` on the same documents):
    the value is the mean over draws, and the interval pools every (draw, replicate) pair, so it
    holds both the spread between draws and the resampling of documents."""
    weights = document_weights(len(per_doc[0]), draws, seed)
    value = sum(float(statistic(p.double().sum(0))) for p in per_doc) / len(per_doc)
    return _interval(value, torch.cat([statistic(weights @ p.double()) for p in per_doc]))


def paired_difference(a: Tensor, b: Tensor, statistic: Statistic, *, draws: int = DRAWS, seed: int = 0) -> Estimate:
    """statistic(a) - statistic(b) of two figures on the same documents (`(D, m)` each, row i of both
    the same document), with a paired interval: each replicate draws the documents once for both."""
    if a.shape != b.shape:
        raise ValueError(f"paired figures need the same documents and columns; got shapes {tuple(a.shape)} "
                         f"and {tuple(b.shape)}")
    m = a.shape[1]
    return bootstrap(torch.cat([a, b], 1), lambda t: statistic(t[..., :m]) - statistic(t[..., m:]), draws=draws,
                     seed=seed)


def per_document(values: Tensor, doc: Tensor, n_docs: int) -> Tensor:
    """Sums `(n_docs, m)` of row values `(N, m)` (or `(N,)`) by their document ids `(N,)`."""
    values = values.double().reshape(len(values), -1)
    return torch.zeros(n_docs, values.shape[1], dtype=torch.float64).index_add_(0, doc.long(), values)


def _interval(value: float, replicates: Tensor) -> Estimate:
    finite = replicates[torch.isfinite(replicates)]
    if not len(finite):
        return Estimate(value, math.nan, math.nan)
    low, high = torch.quantile(finite, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return Estimate(value, low, high)
