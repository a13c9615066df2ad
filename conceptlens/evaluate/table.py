"""The `quality` part of the suite: single-concept probe, geometry, reconstruction and LDA rows.

    rows = metric_rows(cs.directions, train, test, class_names, recon)   # train/test: Features
    print(format_rows(rows))

Tensors in, rows out: no model, no files. `Features` are what the probe sees (documents or
tokens), `ReconStats` streams FVU / L0 / dead fraction over token batches. Every quality
figure comes with its baseline, the value a predictor that knows nothing reaches: a probe's
log-loss next to the base-rate entropy of its class, FVU next to the mean predictor's 1.0,
an LDA cosine next to that of random directions, CE loss recovered next to zero-ablation's 0.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from conceptlens.metrics.quality import effective_rank, lda_directions, max_pairwise_cosine, standardised_probe_loss

BASELINE_DRAWS = 64
"""Random Gaussian directions drawn (seed 0) for the chance level of cosine rows."""


class Features(NamedTuple):
    x: Tensor
    """`(M, d)` activations of the probed units (document means, or tokens)"""
    z: Tensor
    """`(M, n)` concept activations (document means of per-token activations, or per token)"""
    y: Tensor
    """`(M,)` labels"""


class ReconStats:
    """Streamed FVU, L0 and dead fraction over token batches; equal to `quality.fvu`, `l0`,
    `dead_fraction` on the concatenated batches."""

    def __init__(self) -> None:
        self.n, self.err, self.sq, self.nonzero = 0, 0.0, 0.0, 0.0
        self.sum: Tensor | None = None
        self.fired: Tensor | None = None

    def update(self, x: Tensor, z: Tensor, x_hat: Tensor) -> None:
        x = x.double()
        self.err += float((x - x_hat.double()).pow(2).sum())
        self.sq += float(x.pow(2).sum())
        self.sum = x.sum(0) if self.sum is None else self.sum + x.sum(0)
        self.n += len(x)
        self.nonzero += float((z != 0).sum())
        fired = (z != 0).any(0)
        self.fired = fired if self.fired is None else self.fired | fired

    def fvu(self) -> float:
        if self.sum is None:
            raise ValueError("no rows yet: call update first")
        return self.err / (self.sq - float(self.sum.pow(2).sum()) / self.n)

    def l0(self) -> float:
        return self.nonzero / self.n

    def dead_fraction(self) -> float:
        if self.fired is None:
            raise ValueError("no rows yet: call update first")
        return float((~self.fired).double().mean())


class Row(NamedTuple):
    metric: str
    value: float
    note: str = ""
    baseline: float = math.nan
    """what a predictor that knows nothing scores on this row (nan: no meaningful baseline)"""
    baseline_name: str = ""
    """what the baseline is, in two or three words"""


def probe_baselines(y_train: Tensor, y_test: Tensor, classes: Tensor) -> Tensor:
    """`(n_classes,)` test log-loss (nats) of predicting each class's train rate, one-vs-rest: the
    base-rate entropy a one-concept probe must beat."""
    p_train = torch.stack([(y_train == c).double().mean() for c in classes]).clamp(1e-12, 1 - 1e-12)
    p_test = torch.stack([(y_test == c).double().mean() for c in classes])
    return -(p_test * p_train.log() + (1 - p_test) * (1 - p_train).log())


def random_max_cosine(directions: Tensor, n_draws: int = BASELINE_DRAWS) -> float:
    """Median over random Gaussian directions of their largest cosine with any of `directions` `(n, d)`:
    the chance level of "best-aligned concept" cosines."""
    g = torch.Generator().manual_seed(0)
    draws = F.normalize(torch.randn(n_draws, directions.shape[1], generator=g, dtype=torch.float64), dim=1)
    return float((draws @ F.normalize(directions.double(), dim=1).T).max(1).values.median())


def random_pairwise_cosine(n: int, d: int) -> float:
    """Largest pairwise cosine among n random Gaussian directions in d dimensions (seed 0)."""
    g = torch.Generator().manual_seed(0)
    return float(max_pairwise_cosine(torch.randn(n, d, generator=g, dtype=torch.float64)).max())


def probe_candidates(z: Tensor, y: Tensor, per_class: int) -> Tensor:
    """Concepts worth a logistic probe: per class the `per_class` with the largest standardised
    mean difference |mean(class) - mean(rest)| / std on `z` `(M, n)`; sorted unique indices."""
    std = z.double().std(0).clamp_min(1e-12)
    score = torch.stack([(z[y == c].double().mean(0) - z[y != c].double().mean(0)).abs() / std for c in y.unique()])
    return score.topk(min(per_class, z.shape[1]), dim=1).indices.flatten().unique()


def metric_rows(directions: Tensor, train: Features, test: Features, class_names: list[str],
                recon: ReconStats | None = None, candidates: int | None = 16) -> list[Row]:
    """Every metric that applies, as table rows (class rows are indented under their summary).

    The probe fits 1-D logistic regressions only on `probe_candidates(..., candidates)` (all
    concepts when None): a screen that keeps wide dictionaries (thousands of SAE latents times
    dozens of tags) to seconds.
    """
    keep = torch.arange(train.z.shape[1]) if candidates is None else probe_candidates(train.z, train.y, candidates)
    probe = standardised_probe_loss(train.z[:, keep], train.y, test.z[:, keep], test.y)
    bases = probe_baselines(train.y, test.y, probe.classes)
    screened = "" if candidates is None else f" (of {len(keep)} screened)"
    rows = [Row("probe loss (median class)", probe.loss, f"nats; test log-loss of the best single concept per class"
                f"{screened}", float(bases.quantile(0.5)), "base-rate entropy")]
    rows += [Row(f"  {class_names[c]}", float(loss), f"concept {int(keep[j])}", float(base), "base-rate entropy")
             for c, loss, j, base in zip(probe.classes, probe.per_class, probe.best_concept, bases)]
    n, d = directions.shape
    rows.append(Row("effective rank", effective_rank(directions, unit=True),
                    f"of {n} unit directions in {d} dimensions"))
    if n > 1:
        mpc = max_pairwise_cosine(directions)
        rows += [Row("max pairwise cosine", float(mpc.max()), "largest over all pairs", random_pairwise_cosine(n, d),
                     "random directions"),
                 Row("mean max pairwise cosine", float(mpc.mean()), "each concept's closest other, averaged")]
    if recon is not None and recon.n:
        rows += [Row("FVU", recon.fvu(), f"fraction of variance unexplained, {recon.n:,} test tokens", 1.0,
                     "mean predictor"),
                 Row("L0", recon.l0(), "active concepts per token"),
                 Row("dead fraction", recon.dead_fraction(), "concepts that never fired on the test tokens")]
    lda = lda_directions(train.x, train.y)
    cos = F.normalize(lda.directions, dim=1) @ F.normalize(directions.double(), dim=1).T  # (classes, n)
    best = cos.max(1)
    chance = random_max_cosine(directions)
    rows.append(Row("LDA cosine (median class)", float(best.values.quantile(0.5)),
                    "cosine of each class's LDA direction with its best-aligned concept", chance, "random directions"))
    rows += [Row(f"  {class_names[c]}", float(v), f"concept {int(j)}", chance, "random directions")
             for c, v, j in zip(lda.classes, best.values, best.indices)]
    return rows


def format_rows(rows: list[Row]) -> str:
    """metric, value, baseline (`vs NAME VALUE`, blank when none) and note, in aligned columns."""
    width = max(len(r.metric) for r in rows)
    bases = [f"vs {r.baseline_name} {r.baseline:.4f}" if not math.isnan(r.baseline) else "" for r in rows]
    base_width = max(len(b) for b in bases)
    header = f"{'metric':<{width}}  {'value':>10}  {'baseline':<{base_width}}  note"
    return "\n".join([header, *(f"{r.metric:<{width}}  {r.value:10.4f}  {b:<{base_width}}  {r.note}".rstrip()
                                 for r, b in zip(rows, bases))])


def baseline_warnings(rows: list[Row]) -> list[str]:
    """Figures that do no better than their baseline (lower is better for losses and FVU)."""
    lower_better = ("probe loss", "FVU")
    out, classes, worse = [], 0, 0
    in_probe = False
    for row in rows:
        if row.metric.startswith("probe loss"):
            in_probe = True
            continue
        if in_probe and row.metric.startswith("  "):
            classes, worse = classes + 1, worse + (row.value >= row.baseline)
            continue
        in_probe = False
        if row.metric.startswith(lower_better) and row.value >= row.baseline:
            out.append(f"{row.metric} {row.value:.4f} is no better than the {row.baseline_name} ({row.baseline:.4f})")
    if worse:
        out.insert(0, f"{worse} of {classes} classes' probes do no better than their base-rate entropy: those "
                      "concepts carry no information about the class")
    return out
