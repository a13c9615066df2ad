"""The configuration, fit-report numbers and state of `Deleuzian` (deleuzian.py).

    DeleuzianConfig(n_concepts=512, mode="paper")   # validated on construction
    dz.stats()                                      # a DeleuzianStats
    dz.state()                                      # a DeleuzianState (checkpoints, merges)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import Tensor

from conceptlens._checks import check_bool, check_choice, check_float, check_int
from conceptlens.concepts.base import check_dtype
from conceptlens.concepts.kmeans_config import UNITS, KMeansState, KMeansStats

MODES = ("streaming", "paper")


@dataclass
class DeleuzianConfig:
    """Hyper-parameters of `Deleuzian`."""

    n_concepts: int
    """Number of centroids (concepts)."""
    reference_size: int = 4096
    """Rows of the reservoir sample of activations used to measure skewness."""
    buffer_size: int = 16384
    """Rows the mixing buffer holds before it hands out blocks."""
    batch_size: int = 2048
    """Tokens per block; each block gives as many differences, one k-means step."""
    skew_weighting: bool = True
    """Weight each difference by 1/|skewness| (the paper's); False weights all equally, which the demo
    uses over document means, where the skewed differences are the topics (EVALUATION.md "Demo defaults")."""
    reseed_after: float | None = 50.0
    """Dead-centroid reseeding of the inner StreamingKMeans (see KMeansConfig)."""
    seed: int = 0
    """Seed of the private generators (reservoir, buffer, k-means)."""
    mode: str = "streaming"
    """"streaming": one pass, mini-batch k-means, skewness over the reservoir. "paper": the
    released code's algorithm (see `conceptlens.concepts.deleuzian_paper`): differences kept
    in a reservoir, skewness over all samples with each difference's endpoints, full weighted
    k-means (k-means++ then Lloyd) at flush."""
    max_differences: int = 65536
    """Paper mode: differences kept (a uniform sample once the stream is longer)."""
    max_iter: int = 300
    """Paper mode: Lloyd iterations at most (the released code's sklearn default)."""
    skew_rows: int | None = None
    """Streaming mode: reservoir rows each block's skewness is measured on, drawn afresh for
    every block (uniformly, without replacement), so over blocks every reservoir row counts
    alike. None means max(n_concepts, 256), capped at reference_size: the skewness then costs
    what the block's k-means step costs (m x skew_rows x d against m x k x d). Set it to
    reference_size for the whole reservoir (8x the k-means step at k 512, R 4096)."""
    dtype: str = "float32"
    """Compute dtype ("float32" or "bfloat16"): the mixing buffer and the activation reservoir
    are stored in it and the skewness projections run in it; moments are summed in float32 and
    the inner k-means keeps float32 centres and float64 masses (see `StreamingKMeans`). Paper
    mode keeps its differences, reference and skewness in float32 / float64 whatever it is."""
    unit: str = "token"
    """One sample: "token" (each row) or "document": the mean of each document's rows (`update(x,
    tokens=...)`, which `fit` passes; a document's rows in one call), as the paper clusters
    differences of sentence or document representations."""

    def __post_init__(self) -> None:
        for name in ("n_concepts", "reference_size", "buffer_size"):
            check_int(name, getattr(self, name))
        check_int("batch_size (a pair needs two tokens)", self.batch_size, 2)
        check_bool("skew_weighting", self.skew_weighting)
        check_float("reseed_after", self.reseed_after, strict=True, optional=True)
        check_int("seed", self.seed, 0)
        check_choice("mode", self.mode, MODES)
        check_choice("unit", self.unit, UNITS)
        check_int("max_differences", self.max_differences)
        check_int("max_iter", self.max_iter)
        check_int("skew_rows", self.skew_rows, optional=True)
        self.dtype = check_dtype("dtype", self.dtype)

    @property
    def rows_for_skewness(self) -> int:
        """Reference rows per block's skewness in streaming mode (see `skew_rows`)."""
        rows = self.skew_rows if self.skew_rows is not None else max(self.n_concepts, 256)
        return min(rows, self.reference_size)


class DeleuzianStats(NamedTuple):
    """Fit-report numbers of a Deleuzian extractor."""

    rows: int
    """Tokens consumed."""
    buffered: int
    """Tokens still in the mixing buffer (paired at `flush`)."""
    kmeans: KMeansStats
    """The inner k-means of the differences."""


@dataclass
class DeleuzianState:
    """What a `Deleuzian` checkpoint and merge hold: `dz.state()` (a copy), `dz.load_state(state)`."""

    d: int | None
    n_seen: int
    """Rows consumed."""
    reference: Tensor | None
    """(min(n_seen, reference_size), d) the reservoir sample of the activations (None before any)."""
    generator: Tensor
    """The private generator's state (reservoir, pairing, skewness rows)."""
    buffer: dict[str, Any]
    """The mixing buffer's `state_dict()`."""
    kmeans: KMeansState
    """The inner k-means of the differences."""
    differences: dict[str, Any] | None
    """Paper mode's `DifferenceReservoir.state_dict()` (None in states saved before paper mode)."""

    def to_dict(self, config: dict[str, Any], kmeans: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint layout (`state_dict()`); `kmeans`: the inner k-means's config dict."""
        return {"config": config, "d": self.d, "n_seen": self.n_seen, "reference": self.reference,
                "generator": self.generator, "buffer": self.buffer, "kmeans": self.kmeans.to_dict(kmeans),
                "differences": self.differences}

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> DeleuzianState:
        """The state of a `to_dict` layout."""
        return cls(state["d"], state["n_seen"], state["reference"], state["generator"], state["buffer"],
                   KMeansState.from_dict(state["kmeans"]), state.get("differences"))
