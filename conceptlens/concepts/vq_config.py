"""The configuration, result and state types of `VQCodebook` (vq.py).

    VQConfig(n_codes=512, batch_size=4096, dtype="bfloat16")   # validated on construction
    vq.stats()                                                 # a VQStats
    vq.train_step(x)                                           # a VQStep
    vq.fitted                                                  # a CodebookState, once initialised
    vq.state()                                                 # a VQState (checkpoints, merges)
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch
from torch import Tensor

from conceptlens._checks import check_choice, check_float, check_fraction, check_int
from conceptlens.concepts.base import MAX_CONCEPTS, check_dtype
from conceptlens.concepts.vq_math import INIT_METHODS, InitMethod, codes_from_ema, laplace_smooth


DISTANCES = ("squared", "euclidean")
"""What a codebook's sampling softmax takes (`VQConfig.distance`)."""


@dataclass
class VQConfig:
    """Hyper-parameters of a `VQCodebook`."""

    n_codes: int
    """Number of codes K."""
    decay: float = 0.99
    """EMA decay of the assignment counts and sums, per step."""
    eps: float = 1e-5
    """Laplace smoothing of the counts: n_i = (N_i + eps) / (N + K eps) * N."""
    top_k: int = 5
    """Training draws each token's code among its top_k nearest (1 = nearest only)."""
    temperature: float = 1.0
    """Sampling temperature T of softmax(-distance / T) (`distance`); 0 = nearest."""
    init: InitMethod = "kmeans"
    """Codebook initialisation on the first init_size tokens."""
    init_size: int | None = None
    """Tokens collected before initialising; None = 16 * n_codes."""
    reseed_after: int | None = 100
    """Every this many steps, dead codes are replaced by random recent tokens; None = never."""
    reseed_threshold: float = 0.03
    """A code is dead (and unused in `usage`) when its EMA count is below this fraction of
    the uniform share N / K."""
    batch_size: int | None = None
    """Rows per EMA step, drawn at random from a mixing buffer; None = one step per call."""
    buffer_size: int | None = None
    """Rows the mixing buffer holds before drawing a batch; None = 4 * batch_size."""
    seed: int = 0
    """Seed of the private generator (k-means init, sampling, reseeding)."""
    dtype: str = "float32"
    """Compute dtype ("float32" or "bfloat16"): rows are buffered and the training step's
    distances computed in it; the EMA counts and sums, the codes derived from them and the
    initialising k-means stay float32, hits int64 and FVU sums float64. `assign` / `encode`
    measure distances in float32."""
    distance: str = "squared"
    """What the sampling softmax takes: "squared" Euclidean distances, as the CLVQ-VAE's released
    quantiser (T in squared activation units: at T = 1 a code whose squared distance exceeds the
    nearest's by a few units is rarely drawn), or "euclidean" ones (T in activation units; what
    codebooks saved before this option sampled with, and still do when resumed)."""

    def __post_init__(self) -> None:
        check_int("n_codes", self.n_codes, high=MAX_CONCEPTS)
        self.dtype = check_dtype("dtype", self.dtype)
        check_int("top_k", self.top_k)
        for name in ("init_size", "reseed_after", "batch_size", "buffer_size"):
            check_int(name, getattr(self, name), optional=True)
        check_fraction("decay", self.decay)
        for name in ("eps", "temperature", "reseed_threshold"):
            check_float(name, getattr(self, name))
        check_choice("init", self.init, INIT_METHODS)
        check_choice("distance", self.distance, DISTANCES)
        check_int("seed", self.seed, 0)
        if self.rows_to_init < self.n_codes:
            raise ValueError(f"init_size={self.rows_to_init} is smaller than n_codes={self.n_codes}: "
                             f"initialisation needs at least one token per code")

    @property
    def rows_to_init(self) -> int:
        """Tokens collected before initialising (init_size, or 16 * n_codes if None)."""
        return self.init_size if self.init_size is not None else 16 * self.n_codes


class VQStats(NamedTuple):
    """Fit-report numbers of a codebook (EMA over recent steps)."""

    usage: float
    """Fraction of codes whose EMA count is at least reseed_threshold * N / K."""
    perplexity: float
    """exp(entropy) of the EMA assignment distribution: K when uniform, 1 when collapsed."""
    fvu: float
    """Fraction of variance unexplained by the nearest code, EMA over recent steps."""
    steps: int
    tokens: int


class VQStep(NamedTuple):
    """What one training step did: the sampled code per token and that code's vector
    before the step's EMA update (what a straight-through estimator passes on)."""

    code: Tensor        # (N,) long
    quantized: Tensor   # (N, d)


@dataclass
class CodebookState:
    """The fitted part of a `VQCodebook`; it exists once the codebook is initialised."""

    codes: Tensor       # (K, d) = sums / smooth(counts)
    counts: Tensor      # (K,) EMA of sampled-assignment counts
    sums: Tensor        # (K, d) EMA of the sums of assigned tokens
    hits: Tensor        # (K,) int64 nearest-code assignments over all steps
    fvu: Tensor         # (d + 3,) float64 EMA of fvu_sums

    @classmethod
    def from_clusters(cls, centres: Tensor, labels: Tensor, rows_per_step: float, eps: float) -> CodebookState:
        """The EMA state of codes initialised on clusters: `centres` (K, d) of rows labelled `labels` (M,),
        weighing like one step of `rows_per_step` rows."""
        counts = torch.bincount(labels, minlength=len(centres)).to(centres) * (rows_per_step / len(labels))
        sums = centres * laplace_smooth(counts, eps)[:, None]
        return cls(codes_from_ema(counts, sums, eps), counts, sums,
                   torch.zeros(len(centres), dtype=torch.long, device=centres.device),
                   torch.zeros(centres.shape[1] + 3, dtype=torch.float64, device=centres.device))


@dataclass
class SharedStart:
    """The state replicas of a codebook started from (its initialisation, its last merge, or
    `mark_shared_start()`): a merge counts it once."""

    counts: Tensor
    sums: Tensor
    hits: Tensor
    fvu: Tensor
    steps: int
    tokens: int

    @classmethod
    def of(cls, fitted: CodebookState, steps: int, tokens: int) -> SharedStart:
        return cls(fitted.counts.clone(), fitted.sums.clone(), fitted.hits.clone(), fitted.fvu.clone(), steps, tokens)


@dataclass
class VQState:
    """What a `VQCodebook` checkpoint and merge hold: `vq.state()` (a copy), `vq.load_state(state)`."""

    d: int | None
    fitted: CodebookState | None
    pending: Tensor | None
    """Rows collected for the initialisation (None once it ran)."""
    init_calls: int
    """`update` calls that collected them (the initial EMA counts weigh like one of them)."""
    steps: int
    tokens: int
    generator: Tensor
    """The private generator's state (initialisation, sampling, reseeding)."""
    origin: SharedStart | None
    mixer: dict[str, Any] | None
    """The mixing buffer's `state_dict()` (None without `batch_size`)."""

    def to_dict(self, config: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint layout (`state_dict()`)."""
        return {"config": config, "d": self.d, "fitted": _fields(self.fitted), "pending": self.pending,
                "init_calls": self.init_calls, "steps": self.steps, "tokens": self.tokens,
                "generator": self.generator, "origin": _fields(self.origin), "mixer": self.mixer}

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> VQState:
        """The state of a `to_dict` layout (older states may lack the origin and the mixer)."""
        fitted, origin = state["fitted"], state.get("origin")
        return cls(state["d"], None if fitted is None else CodebookState(**fitted), state["pending"],
                   state["init_calls"], state["steps"], state["tokens"], state["generator"],
                   None if origin is None else SharedStart(**origin), state.get("mixer"))


def _fields(obj: Any) -> dict[str, Any] | None:
    """A dataclass's fields as a dict, not copied (None stays None)."""
    return None if obj is None else {f.name: getattr(obj, f.name) for f in fields(obj)}
