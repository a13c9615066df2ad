"""The linear probe of `faithfulness`: a multinomial logistic regression on pooled activations.

    probe = fit_probe(x_train, y_train)           # equals sklearn's LogisticRegression on standardised x
    probe_scores(probe, x_test, y_test)           # {"log_loss": nats, "accuracy": fraction}
    pool(acts, row, position, n_texts, "mean")    # per-text features from flat token rows

Pure tensor math, plus `ProbeTask`, the task description `faithfulness` takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


class LinearProbe(NamedTuple):
    """Multinomial logistic regression on standardised features."""

    mean: Tensor   # (d,)
    scale: Tensor  # (d,)
    weight: Tensor  # (K, d)
    bias: Tensor   # (K,)

    def logits(self, x: Tensor) -> Tensor:
        """(N, d) -> (N, K)"""
        return ((x.double() - self.mean) / self.scale) @ self.weight.T + self.bias


def fit_probe(x: Tensor, y: Tensor, C: float = 1.0, max_iter: int = 500) -> LinearProbe:
    """Fit a multinomial logistic probe: `(N, d)`, labels `(N,)` in 0..K-1 -> LinearProbe.

    Minimises sklearn's `LogisticRegression(C=C)` objective on standardised features,
    C * sum of log-losses + |W|^2 / 2 (intercepts free), with L-BFGS in float64.
    """
    if not (C > 0 and math.isfinite(C)):
        raise ValueError(f"C must be a positive finite number; got {C}")
    x, y = x.double(), y.long()
    mean, scale = x.mean(0), x.std(0, correction=0)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant features stay 0
    z = (x - mean) / scale
    weight = torch.zeros(int(y.max()) + 1, x.shape[1], dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(weight.shape[0], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([weight, bias], max_iter=max_iter, tolerance_grad=1e-10, tolerance_change=1e-14,
                            history_size=20, line_search_fn="strong_wolfe")

    def objective() -> Tensor:
        opt.zero_grad()
        loss = C * F.cross_entropy(z @ weight.T + bias, y, reduction="sum") + 0.5 * weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(objective)
    return LinearProbe(mean, scale, weight.detach(), bias.detach())


def probe_scores(probe: LinearProbe, x: Tensor, y: Tensor) -> dict[str, float]:
    """Mean log-loss (nats) and accuracy of `probe` on `(N, d)` features with labels `(N,)`."""
    logits = probe.logits(x)
    return {"log_loss": float(F.cross_entropy(logits, y.long())),
            "accuracy": float((logits.argmax(-1) == y).double().mean())}


def pool(acts: Tensor, row: Tensor, position: Tensor, n_rows: int, how: Literal["mean", "last"]) -> Tensor:
    """Per-text features from flat token activations `(N, d)` -> `(n_rows, d)`.

    "mean" averages each text's tokens after its first (the first is an attention sink whose
    norm can be 100x the others); a one-token text keeps its only token. "last": last token.
    """
    if how == "last":
        last = torch.zeros(n_rows, dtype=torch.long).scatter_reduce(0, row, position, "amax")
        return acts[position == last[row]]  # flat rows are in (row, position) order: one per text
    use = (position > 0) | (torch.bincount(row, minlength=n_rows)[row] == 1)
    order = torch.argsort(row[use], stable=True)
    counts = torch.bincount(row[use], minlength=n_rows)  # (n_rows,)
    # segment sums as differences of a running sum (index_add_ can be 1000x slower on a busy CPU)
    running = F.pad(acts[use][order].double().cumsum(0), (0, 0, 1, 0))  # (N_used + 1, d)
    ends = counts.cumsum(0)
    return ((running[ends] - running[ends - counts]) / counts.clamp(min=1)[:, None]).float()


@dataclass
class ProbeTask:
    """A linear probe on clean activations, scored under ablation on held-out texts."""

    labels: Sequence[int] | Sequence[str] | Tensor
    """One label per text: class indices 0..K-1, or names (numbered in sorted order)."""
    site: str | None = None
    """Where the probe reads: the ablated site or any later one (default: the concepts' site)."""
    pool: Literal["mean", "last"] = "mean"
    """How a text's tokens become one feature vector (see `pool`)."""
    metric: Literal["log_loss", "accuracy"] = "log_loss"
    """What the result reports."""
    test_fraction: float = 0.5
    """Share of texts held out from the probe's training, drawn with the seed."""
    C: float = 1.0
    """Inverse L2 strength of the probe, as in sklearn."""
    y: Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        labels = self.labels
        if len(labels) and isinstance(labels[0], str):
            index = {name: i for i, name in enumerate(sorted(set(labels)))}
            labels = [index[name] for name in labels]
        self.y = torch.as_tensor(labels, dtype=torch.long).reshape(-1)
        if len(self.y) and self.y.min() < 0:
            raise ValueError(f"labels must be class indices 0..K-1; got {int(self.y.min())}")
        if len(torch.unique(self.y)) < 2:
            raise ValueError(f"labels need at least two classes; got {torch.unique(self.y).tolist()}")
        if self.pool not in ("mean", "last"):
            raise ValueError(f"pool must be 'mean' or 'last'; got {self.pool!r}")
        if self.metric not in ("log_loss", "accuracy"):
            raise ValueError(f"metric must be 'log_loss' or 'accuracy'; got {self.metric!r}")
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"test_fraction must be in (0, 1); got {self.test_fraction}")
