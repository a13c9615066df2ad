"""The protocol every online concept extractor follows, and the base class that implements it.

    km = StreamingKMeans(n_concepts=64)
    for x in stream:            # x: (N, d) float32
        km.update(x)
    km.flush()                  # end of stream
    cs = km.concept_set()
    km.stats()                  # a NamedTuple of fit-report numbers
    km.merge(other)             # another worker's extractor, or its (reduced) state_dict()

Extractors are tensors in, tensors out: they import neither `hooks/` nor `transformers`.
`ExtractorBase` owns what every extractor shares: the config dataclass (checked with the
validators of `conceptlens._checks`), `state_dict` / `load_state_dict` as the checkpoint layout
of a state dataclass (`state()` / `load_state()`) with the config check, the dispatch of
`merge` (object or state dict), `stats()` and device placement (`device=`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, Self, runtime_checkable

import torch
from torch import Tensor

from conceptlens._checks import check_device
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
        """Combine another extractor (or its state dict) fitted on other data."""

    def stats(self) -> Any:
        """Fit-report numbers (a NamedTuple)."""

    def encode(self, x: Tensor) -> Tensor:
        """`(N, d) -> (N, n_concepts)` concept activations."""

    def concept_set(self) -> ConceptSet:
        """The fitted concepts as directions in activation space, with metadata."""


MAX_CONCEPTS = 2**26
"""Most concepts (latents, centres, codes) an extractor may have: 67M, 4x the largest published
SAE; past it the dictionary alone would not fit in any machine's memory at a model's width."""


DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Compute dtypes an extractor accepts (`dtype=` in its config). float16 is left out: its range
(65504) does not hold squared distances of residual rows (|x|^2 ~ 3e4 at SmolLM2's median norm)
and SAE gradients in it need loss scaling."""


def check_dtype(name: str, value: Any) -> str:
    """The dtype's name (`"bfloat16"` for `torch.bfloat16` or `"bfloat16"`); raise a one-line
    ValueError naming the valid choices otherwise."""
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    if value not in DTYPES:
        raise ValueError(f"{name} must be one of {tuple(DTYPES)}; got {value!r}")
    return value


def config_json(config: Any) -> dict[str, Any]:
    """A config dataclass as plain JSON types (tuples become lists, nested dicts copied)."""
    def plain(v: Any) -> Any:
        if isinstance(v, (tuple, list)):
            return [plain(e) for e in v]
        if isinstance(v, dict):
            return {k: plain(e) for k, e in v.items()}
        return v
    return {f.name: plain(getattr(config, f.name)) for f in dataclasses.fields(config)}


def config_differences(saved: dict[str, Any], mine: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, saved, this) for every key whose value differs."""
    return [(k, saved.get(k), mine.get(k)) for k in sorted(saved.keys() | mine.keys()) if saved.get(k) != mine.get(k)]


def map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """`fn` applied to every tensor of a nested state (dicts, lists, tuples, state dataclasses);
    RNG states (uint8 tensors) are left alone, since generators live on the CPU."""
    if isinstance(obj, Tensor):
        return obj if obj.dtype == torch.uint8 else fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


class ExtractorBase:
    """What every extractor shares; a subclass sets `Config`, `State` and `method` and implements
    `update`, `flush`, `state`, `load_state`, `_merge`, `stats`, `encode`, `concept_set`
    (those it has).

    - `self.config` is an instance of `Config` (a validated dataclass); `config_dict()` is
      its JSON form, stored under `"config"` in every state dict and checked by
      `check_state` before a state is loaded.
    - `state()` returns an instance of `State` (a dataclass: a copy of everything a
      checkpoint or a merge needs) and `load_state(state)` continues from one; `state_dict()`
      is `State.to_dict` (the checkpoint layout) and `load_state_dict` reads it back with
      `State.from_dict`. Persistence and merges read and write these states, never the
      object's private fields.
    - `merge(other)` accepts another extractor of the same class or its `state_dict()` (for
      instance one reduced across processes), rebuilds the object when given a dict and
      calls `_merge(other)`.
    - `device`: None follows the first input's device; a device puts the state there and
      moves inputs to it. `to(device)` moves a fitted extractor.
    """

    Config: ClassVar[type]
    State: ClassVar[Any]
    """The state dataclass, with `to_dict(config)` and the classmethod `from_dict(state_dict)`."""
    method: ClassVar[str] = "custom"
    legacy_config: ClassVar[dict[str, Any]] = {}
    """Config values that states saved before a key existed were fitted with (a missing key is
    read as these, not as today's default, so an old checkpoint resumes as it was fitted)."""
    distributed: ClassVar[str | None] = None
    """How ranks fed their own rows by hand stay in step: "step" (collectives inside every
    update, through `comm`), "merge" (states merged once at the end), None (not supported).
    `fit(distributed=True)` needs neither: it gives every rank the gathered global rows."""
    config: Any
    d: int | None = None
    """The input width, set by the first rows (`_check_width`)."""
    device: torch.device | None = None
    comm: Any = None
    """A `conceptlens.distributed.Comm` set by a caller that feeds each rank its own rows, else None."""

    if TYPE_CHECKING:  # a subclass with a `State` defines these (one without overrides `state_dict`)
        def state(self) -> Any: ...

        def load_state(self, state: Any) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit for bit: `state()` in the checkpoint layout, with the config."""
        return self.state().to_dict(self.config_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict()`, saved with the same constructor arguments (checked first)."""
        self.check_state(state)
        self.load_state(self.State.from_dict(state))

    def _set_device(self, device: str | torch.device | None) -> None:
        self.device = None if device is None else check_device("device", device)

    def _check_width(self, x: Tensor) -> None:
        """Raise a one-line ValueError unless `x` is `(N, d)` at this extractor's width `d`;
        the first rows set it."""
        if x.ndim != 2:
            raise ValueError(f"expected x of shape (N, d); got {tuple(x.shape)}")
        if self.d is None:
            self.d = x.shape[1]
        elif x.shape[1] != self.d:
            raise ValueError(f"expected width d={self.d} (fixed by the first rows this {type(self).__name__} "
                             f"took); got width {x.shape[1]}")

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of this extractor's compute (its config's `dtype`; float32 without one).
        Accumulated statistics and master parameters stay float32 (or wider) whatever it is."""
        return DTYPES[getattr(self.config, "dtype", "float32")]

    def _place(self, x: Tensor) -> Tensor:
        """`x` on this extractor's device (unchanged when it follows its inputs)."""
        return x if self.device is None else x.to(self.device)

    def _placed(self, state: Any) -> Any:
        """`state` (a dict or a state dataclass) with its tensors on this extractor's device
        (unchanged when it has none)."""
        return state if self.device is None else map_tensors(state, lambda t: t.to(self.device))

    # ---- config -------------------------------------------------------------------------
    def config_dict(self) -> dict[str, Any]:
        return config_json(self.config)

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise a one-line ValueError unless `state` was saved with this object's config."""
        if not isinstance(state, dict) or "config" not in state:
            raise ValueError(f"not a {type(self).__name__} state: expected a dict with a 'config' entry")
        saved_class = state.get("class")
        if saved_class is not None and saved_class != type(self).__name__:
            raise ValueError(f"state is for a {saved_class!r}; this is a {type(self).__name__!r}")
        mine = self.config_dict()
        legacy = {**({"dtype": "float32"} if "dtype" in mine else {}), **self.legacy_config}  # older states
        saved = {**{k: v for k, v in legacy.items() if k in mine}, **state["config"]}
        differ = config_differences(saved, mine)
        if differ:
            raise ValueError(f"state was saved with a different config: {differ} (key, saved, this)")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        """A fresh object from `config_dict()` output (subclasses with other constructors override)."""
        names = {f.name for f in dataclasses.fields(cls.Config)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k in names})

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Self:
        """A fresh object that has loaded `state`."""
        if not isinstance(state, dict) or "config" not in state:
            raise ValueError(f"not a {cls.__name__} state: expected a dict with a 'config' entry")
        obj = cls.from_config({**cls.legacy_config, **state["config"]})
        obj.load_state_dict(state)
        return obj

    # ---- merging --------------------------------------------------------------------------
    def merge(self, other: Any) -> None:
        """Absorb another worker's extractor (same class and config) or its `state_dict()`."""
        if isinstance(other, dict):
            other = type(self).from_state(other)
        if type(other) is not type(self):
            raise TypeError(f"can only merge a {type(self).__name__} with another; got {type(other).__name__}")
        self._merge(other)

    def _merge(self, other: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not merge")

    # ---- reporting and placement ------------------------------------------------------------
    def stats(self) -> NamedTuple:  # pragma: no cover - every extractor overrides
        raise NotImplementedError(f"{type(self).__name__} must define stats()")

    def to(self, device: str | torch.device) -> ExtractorBase:
        """Move every tensor of the state to `device` (and place later inputs there); returns self."""
        device = check_device("device", device)
        state = map_tensors(self.state_dict(), lambda t: t.to(device))
        self._set_device(device)
        self.load_state_dict(state)
        return self
