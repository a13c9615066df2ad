"""SAEConfig: the hyper-parameters every sparse autoencoder shares, validated on creation.

    cfg = SAEConfig(width=4608, batch_size=4096)
    cfg.learning_rate()                    # lr, or the width-scaled default
    short_budget_lr(4608, steps=250, batch_size=4096)   # the lr for a fit known to take 250 steps
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

# the shared validation helpers (re-exported here, where the variants import them from)
from conceptlens._checks import check_choice, check_float, check_int
from conceptlens.concepts.base import MAX_CONCEPTS, check_dtype, config_json

__all__ = ["SAEConfig", "build_config", "check_int", "check_float", "short_budget_lr"]


@dataclass(kw_only=True)
class SAEConfig:
    """Shared SAE hyper-parameters; each variant's config adds its own fields."""

    width: int
    """Number of latents (dictionary size)."""
    lr: float | None = None
    """Adam learning rate; None scales it with width as 2e-4 * sqrt(16384 / width) (Gao et al.,
    fitted for long runs; `conceptlens fit` passes `short_budget_lr` instead when it knows the budget)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's moment decay rates."""
    batch_size: int = 4096
    """Tokens per optimiser step."""
    buffer_size: int | None = None
    """Rows the mixing buffer keeps before drawing a batch; None means 4 * batch_size."""
    warmup_tokens: int = 4096
    """Tokens over which the input scale (E||x||^2 = d) is estimated before the first step."""
    dead_after: int = 10_000_000
    """A latent is dead when it has not fired in this many tokens (Gao et al.'s 10M for the TopK
    SAE's AuxK; the SpaDE paper's baselines count 20 batches, as `reproductions/spade_f1.py` sets
    it: 5,000 tokens at batch 256). At budgets below it no latent is dead and AuxK stays off."""
    b_dec_init: Literal["geometric_median", "mean", "zeros"] = "geometric_median"
    """Where the pre-encoder bias starts, computed on the first batch."""
    dtype: str = "float32"
    """Compute dtype ("float32" or "bfloat16"), in the standard mixed-precision pattern: the
    forward and backward matmuls run in it on cast copies of the parameters, while the master
    parameters, their gradients, Adam's moments, the reconstruction loss and every statistic
    stay float32 (firing counts int64, running means float64). Buffered rows are stored in it."""

    def __post_init__(self) -> None:
        check_int("width", self.width, high=MAX_CONCEPTS)
        if self.lr is not None:
            check_float("lr", self.lr, strict=True)
        betas = tuple(self.betas) if isinstance(self.betas, (list, tuple)) else ()
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1); got {self.betas!r}")
        self.betas = (float(betas[0]), float(betas[1]))
        check_int("batch_size", self.batch_size)
        if self.buffer_size is not None:
            check_int("buffer_size", self.buffer_size)
        check_int("warmup_tokens", self.warmup_tokens)
        check_int("dead_after", self.dead_after)
        check_choice("b_dec_init", self.b_dec_init, ("geometric_median", "mean", "zeros"))
        self.dtype = check_dtype("dtype", self.dtype)

    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else 2e-4 * math.sqrt(16384 / self.width)

    def mixing_size(self) -> int:
        return self.buffer_size if self.buffer_size is not None else 4 * self.batch_size

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types (tuples become lists)."""
        return config_json(self)


LONG_RUN_STEPS = 16_000
"""`short_budget_lr`'s horizon: its step factor sqrt(LONG_RUN_STEPS / steps) is 1 here (Gao et al.'s lr)."""
MAX_MULTIPLE = 16.0
"""The largest step factor of `short_budget_lr` (fits of 62 steps or fewer)."""
NOISE_BATCH = 256
"""`short_budget_lr`'s batch factor batch / (batch + NOISE_BATCH) halves the lr at this batch size:
smaller batches carry noisier gradients."""


def short_budget_lr(width: int, steps: int, batch_size: int) -> float:
    """Adam lr for an SAE fit known to take `steps` optimiser steps of `batch_size` tokens, which
    `conceptlens fit` (and the demo) give an SAE whose spec sets no lr when --max-tokens is known:
    Gao et al.'s width rule (`SAEConfig.learning_rate`, fitted for long runs) times

        max(1, min(16, sqrt(16000 / steps)) * batch_size / (batch_size + 256)).

        short_budget_lr(16384, steps=250, batch_size=3840)   # 2e-4 * 8 * 0.9375 = 1.5e-3

    Measured (`benchmarks/lr_budget.py`, BENCHMARKS.md): TopK width 2304 k 32 on SmolLM2 block-15
    rows, held-out FVU was best near 16x (15 steps), 14x (60) and 8x (250) at batch 4096, near 14x
    (15), 11x (60) and 6x (240) at batch 1024; the demo's SAE (width 1024, bbc-news, batch 128, 195
    steps) near 2.5x. Past the 250 steps measured the step factor keeps falling as 1 / sqrt(steps),
    as SGD's best constant step for a horizon of T steps does (an extrapolation): at batch 4096 the
    lr is Gao's from about 14k steps (58M tokens) on. An SAE constructed directly
    (`TopKSAE(width=...)`) knows no budget and keeps Gao's rule."""
    check_int("width", width)
    check_int("steps", steps)
    check_int("batch_size", batch_size)
    multiple = min(MAX_MULTIPLE, math.sqrt(LONG_RUN_STEPS / steps)) * batch_size / (batch_size + NOISE_BATCH)
    return max(1.0, multiple) * SAEConfig(width=width).learning_rate()


C = TypeVar("C", bound=SAEConfig)


def build_config(cls: type[C], config: C | None, kwargs: dict[str, Any]) -> C:
    """A config of type `cls` from either a ready config or keyword arguments (not both)."""
    if config is not None:
        if kwargs:
            raise TypeError(f"pass either a {cls.__name__} or keyword arguments, not both; got {sorted(kwargs)}")
        if not isinstance(config, cls):
            raise TypeError(f"expected a {cls.__name__}; got {type(config).__name__}")
        return config
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(kwargs) - set(names))
    if unknown:
        raise TypeError(f"unknown argument(s) {unknown}; valid: {names}")
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in kwargs]
    if missing:
        raise TypeError(f"missing required argument(s) {missing}")
    return cls(**kwargs)
