"""The configuration and result types of `VQCodebook` (vq.py).

    VQConfig(n_codes=512, batch_size=4096, dtype="bfloat16")   # validated on construction
    vq.stats()                                                 # a VQStats
    vq.train_step(x)                                           # a VQStep
    vq.fitted                                                  # a CodebookState, once initialised
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor

from conceptlens._checks import check_choice, check_float, check_fraction, check_int
from conceptlens.concepts.base import MAX_CONCEPTS, check_dtype
from conceptlens.concepts.vq_math import INIT_METHODS, InitMethod


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
    """Sampling temperature T of softmax(-distance / T); 0 = nearest."""
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
