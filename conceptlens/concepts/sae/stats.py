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
        self._last: Tensor | list[float] | None = None  # (4,) float64: on the device while training
        self._ema: Tensor | list[float] = [0.0] * len(StepStats._fields)
        self.origin: int | None = None  # tokens at the shared start of replicas (`mark_shared_start`)

    def observe(self, step: Tensor, n_tokens: int) -> None:
        """`step`: the 4 `StepStats` values as a tensor, kept on its device (no host read per step);
        float64 arithmetic, so the averages equal Python-float ones bit for bit."""
        step = step.detach().double()
        ema = torch.as_tensor(self._ema, dtype=torch.float64, device=step.device)
        self.steps += 1
        self.tokens += n_tokens
        self._last = step
        self._ema = self.decay * ema + (1 - self.decay) * step

    @property
    def last(self) -> StepStats | None:
        return None if self._last is None else StepStats(*_floats(self._last))

    def summary(self) -> SAEStats:
        mean = None
        if self.steps:
            correction = 1 - self.decay**self.steps
            mean = StepStats(*(m / correction for m in _floats(self._ema)))
        return SAEStats(self.steps, self.tokens, self.last, mean)

    def merge(self, other: RunningStats) -> None:
        """A replica's record: tokens add (those of a shared start both carry, once), steps are the
        larger count (replicas step in parallel), the averages are weighted by tokens."""
        shared = self.origin if self.origin is not None and self.origin == other.origin else 0
        total = self.tokens + other.tokens - shared
        if other.steps and total:
            a, b = self.tokens / (self.tokens + other.tokens), other.tokens / (self.tokens + other.tokens)
            self._ema = [a * m + b * o for m, o in zip(_floats(self._ema), _floats(other._ema))]
            self._last = self._last if self.steps >= other.steps else other._last
        self.steps = max(self.steps, other.steps)
        self.tokens = total

    def state_dict(self) -> dict[str, Any]:
        last = None if self._last is None else _floats(self._last)
        out = {"steps": self.steps, "tokens": self.tokens, "last": last, "ema": _floats(self._ema)}
        return out if self.origin is None else {**out, "origin": self.origin}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.tokens = state["steps"], state["tokens"]
        self.origin = state.get("origin")
        self._last = None if state["last"] is None else list(state["last"])
        self._ema = list(state["ema"])


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, Tensor) else value


def _floats(values: Tensor | list[float]) -> list[float]:
    return values.tolist() if isinstance(values, Tensor) else list(values)


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
        self._bound = 0  # host-side upper bound on max(since_fired), so `none_dead` reads nothing back
        self.origin: dict[str, Any] | None = None  # fired and tokens at the shared start of replicas

    def observe(self, fired_counts: Tensor, n_tokens: int) -> None:
        """`fired_counts` `(width,)`: how many of the step's `n_tokens` tokens each latent fired on."""
        self.fired += fired_counts
        self.since_fired += n_tokens
        self.since_fired.masked_fill_(fired_counts > 0, 0)  # not a boolean index: no host read
        self.tokens += n_tokens
        self._bound += n_tokens

    def none_dead(self) -> bool:
        """True when no latent can be dead yet, decided on the host (no device read)."""
        return self._bound < self.dead_after

    def refresh(self) -> None:
        """Tighten the host bound with one device read (call it now and then, not per step)."""
        self._bound = int(self.since_fired.max()) if self.since_fired.numel() else 0

    def dead(self) -> Tensor:
        """`(width,)` bool."""
        return self.since_fired >= self.dead_after

    def frequency(self) -> Tensor:
        """`(width,)` float32: fraction of trained tokens on which each latent fired."""
        return self.fired.float() / max(self.tokens, 1)

    def state_dict(self) -> dict[str, Any]:
        out = {"fired": self.fired.clone(), "since_fired": self.since_fired.clone(), "tokens": self.tokens}
        return out if self.origin is None else {**out, "origin": {k: _copy(v) for k, v in self.origin.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fired = state["fired"].to(self.fired.device).clone()
        self.since_fired = state["since_fired"].to(self.since_fired.device).clone()
        self.tokens = state["tokens"]
        origin = state.get("origin")
        self.origin = None if origin is None else {"fired": origin["fired"].to(self.fired.device).clone(),
                                                   "tokens": origin["tokens"]}
        self.refresh()

    def mark_shared_start(self) -> None:
        self.origin = {"fired": self.fired.clone(), "tokens": self.tokens}

    def merge(self, other: LatentTracker) -> None:
        """Combine the records of two replicas: counts add (those of a shared start both carry,
        once: `mark_shared_start`), the most recent firing wins."""
        fired, tokens = other.fired.to(self.fired.device), other.tokens
        if self._shares_start(other):
            fired, tokens = fired - self.origin["fired"], tokens - self.origin["tokens"]  # type: ignore[index]
        self.fired += fired
        self.since_fired = torch.minimum(self.since_fired, other.since_fired.to(self.since_fired.device))
        self.tokens += tokens
        self.refresh()

    def _shares_start(self, other: LatentTracker) -> bool:
        a, b = self.origin, other.origin
        return a is not None and b is not None and a["tokens"] == b["tokens"] and \
            torch.equal(a["fired"], b["fired"].to(a["fired"].device))


def geometric_median(x: Tensor, iters: int = 30, eps: float = 1e-8) -> Tensor:
    """The point minimising the summed Euclidean distance to the rows of `x` (Weiszfeld).

    x: (N, d) -> (d,). Robust to outliers, which is why SAEs start b_dec there. The result is
    the point after `iters` Weiszfeld steps. Each step is a function of the current point alone,
    so once a point recurs (in float32 the iteration settles on a fixed point or a cycle of 2-3
    points after 10-15 steps) the point after `iters` steps is read off the cycle: the same bits
    as taking every step. Checked on CPU only (a comparison reads back to the host).
    """
    median = x.mean(0)  # (d,)
    points = [median]  # points[j]: the point after j steps
    for step in range(1, iters + 1):
        median = weiszfeld_step(x, median, eps)
        if x.device.type == "cpu":
            for period in range(1, min(4, step) + 1):
                if torch.equal(median, points[step - period]):  # periodic from step - period on
                    start = step - period
                    return points[start + (iters - start) % period]
        points.append(median)
    return median


def weiszfeld_step(x: Tensor, median: Tensor, eps: float = 1e-8) -> Tensor:
    """One Weiszfeld step from `median` `(d,)`: the mean of the rows of `x` `(N, d)` weighted by
    their inverse distance to it."""
    weights = 1 / (x - median).norm(dim=1).clamp(min=eps)  # (N,)
    return (weights[:, None] * x).sum(0) / weights.sum()
