"""The configuration, fit-report numbers and state of `StreamingKMeans` (kmeans.py).

    KMeansConfig(n_concepts=512, batch_size=4096, dtype="bfloat16")   # validated on construction
    km.stats()                                                       # a KMeansStats
    km.state()                                                       # a KMeansState
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import Tensor

from conceptlens._checks import check_bool, check_choice, check_float, check_int
from conceptlens.concepts.base import MAX_CONCEPTS, check_dtype

UNITS = ("token", "document")
"""What one row of a k-means (or Deleuzian) is: a token's activation, or the mean of a document's."""


def without_token_unit(config: dict[str, Any]) -> dict[str, Any]:
    """A config dict with `unit` left out when it is the default "token": states and sets keep the
    layout they had before the field existed."""
    return {k: v for k, v in config.items() if not (k == "unit" and v == "token")}


@dataclass
class KMeansConfig:
    """Hyper-parameters of `StreamingKMeans`."""

    n_concepts: int
    """Number of centres k."""
    spherical: bool = False
    """Cluster directions: rows and centres are normalised, assignment by cosine similarity."""
    batch_size: int | None = None
    """Rows per minibatch step; None takes each `update` call as one step."""
    init_size: int | None = None
    """Rows buffered before k-means++ initialisation; None means max(3 k, 1024)."""
    reseed_after: float | None = 50.0
    """A centre that received no mass while `reseed_after * k` rows went by (a typical centre
    would have received ~reseed_after rows) is moved to a row far from its centre; None never."""
    seed: int = 0
    """Seed of the private random generator (k-means++, batches, reseeding)."""
    init: str = "auto"
    """Seeding: "k-means++" (greedy, 2 + ln k trials per centre, k sequential steps), "batched"
    (D^2 sampling in 32 rounds of k/32 rows, see `kmeans_math.batched_seeds`: the same matmul
    work in 32 large products, ~10x cheaper at k 4096), or "auto" (k-means++ up to k = 256)."""
    dtype: str = "float32"
    """Compute dtype ("float32" or "bfloat16"): rows are stored (initialisation buffer) and
    assigned (the distance matmul) in it; centres stay float32 and masses float64, and each
    step's per-centre sums are accumulated in float32, so a long stream loses no precision."""
    unit: str = "token"
    """One row: "token" (each activation) or "document": the mean of each document's activations
    (`update(x, tokens=...)`, which `fit` passes; a document's rows in one call). Centres of
    document means are topics rather than token types; a token is still assigned to its nearest.
    `batch_size`, `init_size` and `reseed_after` then count documents: with fewer documents than
    `init_size`, k-means++ runs on all of them at the end of the fit (`flush`)."""

    def __post_init__(self) -> None:
        check_int("n_concepts", self.n_concepts, high=MAX_CONCEPTS)
        check_choice("init", self.init, ("auto", "k-means++", "batched"))
        check_choice("unit", self.unit, UNITS)
        check_bool("spherical", self.spherical)
        check_int("batch_size", self.batch_size, optional=True)
        check_int("init_size", self.init_size, optional=True)
        check_float("reseed_after", self.reseed_after, strict=True, optional=True)
        check_int("seed", self.seed, 0)
        self.dtype = check_dtype("dtype", self.dtype)

    @property
    def rows_to_init(self) -> int:
        return self.init_size if self.init_size is not None else max(3 * self.n_concepts, 1024)

    @property
    def batched_init(self) -> bool:
        return self.init == "batched" or (self.init == "auto" and self.n_concepts > 256)


class KMeansStats(NamedTuple):
    """Fit-report numbers of a k-means (also used by Deleuzian for its inner k-means)."""

    steps: int
    """Minibatch steps taken."""
    rows: int
    """Rows consumed (including those still waiting for the initialisation)."""
    live_fraction: float
    """Fraction of centres that have received mass (nan before the initialisation)."""
    reseeded: int
    """Centres moved by dead-centre reseeding so far."""


@dataclass
class KMeansState:
    """What a `StreamingKMeans` checkpoint and merge hold: `km.state()` (a copy), `km.load_state(state)`."""

    d: int | None
    """Input width (None before the first rows)."""
    centres: Tensor | None
    """(k, d) float32 weighted running means (not normalised); None before k-means++ ran."""
    mass: Tensor
    """(k,) float64 total weight each centre received."""
    idle: Tensor
    """(k,) int64 rows seen since each centre last received mass."""
    pending: tuple[Tensor, Tensor] | None
    """Rows (M, d) and weights (M,) waiting for the initialisation; None once it ran."""
    n_seen: int
    n_reseeded: int
    steps: int
    generator: Tensor
    """The private generator's state (k-means++, reseeding, merging)."""

    def to_dict(self, config: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint layout (`state_dict()`), unchanged since the first version."""
        px, pw = self.pending if self.pending is not None else (None, None)
        return {"config": config, "d": self.d, "steps": self.steps, "centres": self.centres, "mass": self.mass,
                "idle": self.idle, "pending_x": px, "pending_w": pw, "n_seen": self.n_seen,
                "n_reseeded": self.n_reseeded, "generator": self.generator}

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> KMeansState:
        """The state of a `to_dict` layout (states saved before steps were counted have none: 0)."""
        pending = None if state["pending_x"] is None else (state["pending_x"], state["pending_w"])
        return cls(state["d"], state["centres"], state["mass"], state["idle"], pending, state["n_seen"],
                   state["n_reseeded"], state.get("steps", 0), state["generator"])
