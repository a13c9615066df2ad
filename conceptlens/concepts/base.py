"""The protocol every online concept extractor follows.

    km = StreamingKMeans(n_concepts=64)
    for x in stream:            # x: (N, d) float32
        km.update(x)
    cs = km.concept_set()

Extractors are tensors in, tensors out: they import neither `hooks/` nor `transformers`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from conceptlens.concepts.conceptset import ConceptSet


class NotFittedError(ValueError, RuntimeError):
    """Raised by `encode` / `concept_set` of an extractor that has not seen enough rows yet
    (a ValueError like sklearn's, and a RuntimeError)."""


@runtime_checkable
class Extractor(Protocol):
    """An online concept extractor fed `(N, d)` float32 batches of activations.

    The input width d is inferred on the first `update` (lazy initialisation), so one
    object works at any site. `state_dict` holds everything needed to resume bit for bit
    (tensors, Python scalars and strings, nested dicts; RNG states as tensors), and
    `load_state_dict` accepts it on a freshly constructed object with the same arguments.
    """

    def update(self, x: Tensor) -> None:
        """Consume a batch `(N, d)`: O(N) time, memory independent of the stream length."""

    def flush(self) -> None:
        """End of stream: train on rows still held back (mixing buffer, pending batch)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit for bit."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict()`."""

    def merge(self, other: Any) -> None:
        """Combine sufficient statistics of another extractor fitted on other data."""

    def encode(self, x: Tensor) -> Tensor:
        """`(N, d) -> (N, n_concepts)` concept activations."""

    def concept_set(self) -> ConceptSet:
        """The fitted concepts as directions in activation space, with metadata."""
