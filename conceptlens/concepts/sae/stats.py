"""Training statistics of a streaming SAE: per-step FVU / L0 / dead fraction, latent firing.

    tracker = LatentTracker(width=4608, dead_after=10_000_000)
    tracker.observe(fired_counts, n_tokens)          # after every optimiser step
    tracker.dead()                                   # (width,) bool
    geometric_median(x)                              # (N, d) -> (d,), to initialise b_dec
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor


class StepStats(NamedTuple):
    """Reconstruction quality and sparsity of one optimiser step (or a running mean of them)."""

    fvu: float
    """Fraction of variance unexplained: sum ||x - x_hat||^2 / sum ||x - mean(x)||^2 over the batch."""
    l0: float
    """Mean number of nonzero latents per token."""
    dead_fraction: float
    """Fraction of latents that have not fired in the last `dead_after` tokens."""
    loss: float
    """The training loss (reconstruction plus the variant's penalty)."""


class SAEStats(NamedTuple):
    """What a fit report shows: progress, the last step, and running means."""

    steps: int
    tokens: int
    """Tokens trained on (optimiser steps times their batch sizes)."""
    last: StepStats | None
    """The last step; None before the first."""
    mean: StepStats | None
    """Exponential moving averages over about the last 100 steps (bias-corrected)."""


class RunningStats:
    """Bias-corrected exponential moving averages of `StepStats` (Adam's correction).

    An EMA rather than a mean over the whole run: early steps are far from converged and
    would dominate a cumulative mean for most of a fit.
    """

    def __init__(self, decay: float = 0.99) -> None:
        self.decay = decay
        self.steps = 0
        self.tokens = 0
        self.last: StepStats | None = None
        self._ema = [0.0] * len(StepStats._fields)

    def observe(self, step: StepStats, n_tokens: int) -> None:
        self.steps += 1
        self.tokens += n_tokens
        self.last = step
        self._ema = [self.decay * m + (1 - self.decay) * v for m, v in zip(self._ema, step)]

    def summary(self) -> SAEStats:
        mean = None
        if self.steps:
            correction = 1 - self.decay**self.steps
            mean = StepStats(*(m / correction for m in self._ema))
        return SAEStats(self.steps, self.tokens, self.last, mean)

    def merge(self, other: RunningStats) -> None:
        """A replica's record: tokens add, steps are the larger count (replicas step in
        parallel), the averages are weighted by tokens."""
        total = self.tokens + other.tokens
        if other.steps and total:
            a, b = self.tokens / total, other.tokens / total
            self._ema = [a * m + b * o for m, o in zip(self._ema, other._ema)]
            self.last = self.last if self.steps >= other.steps else other.last
        self.steps = max(self.steps, other.steps)
        self.tokens = total

    def state_dict(self) -> dict[str, Any]:
        last = None if self.last is None else list(self.last)
        return {"steps": self.steps, "tokens": self.tokens, "last": last, "ema": list(self._ema)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.tokens = state["steps"], state["tokens"]
        self.last = None if state["last"] is None else StepStats(*state["last"])
        self._ema = list(state["ema"])


class LatentTracker:
    """Per-latent firing counts and tokens since each latent last fired.

    A latent is dead when it has not fired in the last `dead_after` tokens (Gao et al. 2024
    use 10M). Counts are int64, so they do not lose precision over long runs.
    """

    def __init__(self, width: int, dead_after: int, device: torch.device | str = "cpu") -> None:
        self.dead_after = dead_after
        self.fired = torch.zeros(width, dtype=torch.int64, device=device)  # (width,)
        self.since_fired = torch.zeros(width, dtype=torch.int64, device=device)  # (width,)
        self.tokens = 0

    def observe(self, fired_counts: Tensor, n_tokens: int) -> None:
        """`fired_counts` `(width,)`: how many of the step's `n_tokens` tokens each latent fired on."""
        self.fired += fired_counts
        self.since_fired += n_tokens
        self.since_fired[fired_counts > 0] = 0
        self.tokens += n_tokens

    def dead(self) -> Tensor:
        """`(width,)` bool."""
        return self.since_fired >= self.dead_after

    def frequency(self) -> Tensor:
        """`(width,)` float32: fraction of trained tokens on which each latent fired."""
        return self.fired.float() / max(self.tokens, 1)

    def state_dict(self) -> dict[str, Any]:
        return {"fired": self.fired.clone(), "since_fired": self.since_fired.clone(), "tokens": self.tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fired = state["fired"].to(self.fired.device).clone()
        self.since_fired = state["since_fired"].to(self.since_fired.device).clone()
        self.tokens = state["tokens"]

    def merge(self, other: LatentTracker) -> None:
        """Combine the records of two replicas: counts add, the most recent firing wins."""
        self.fired += other.fired.to(self.fired.device)
        self.since_fired = torch.minimum(self.since_fired, other.since_fired.to(self.since_fired.device))
        self.tokens += other.tokens


def geometric_median(x: Tensor, iters: int = 30, eps: float = 1e-8) -> Tensor:
    """The point minimising the summed Euclidean distance to the rows of `x` (Weiszfeld).

    x: (N, d) -> (d,). Robust to outliers, which is why SAEs start b_dec there.
    """
    median = x.mean(0)  # (d,)
    for _ in range(iters):
        weights = 1 / (x - median).norm(dim=1).clamp(min=eps)  # (N,)
        median = (weights[:, None] * x).sum(0) / weights.sum()
    return median
