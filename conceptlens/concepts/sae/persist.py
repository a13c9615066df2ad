"""An SAE checkpoint's state beside the module's tensors, as typed values, and the layouts on disk.

    state = sae.state_dict()                          # tensors by name, the rest under "_extra_state"
    saved = SAEState.from_dict(state["_extra_state"])
    saved.d, saved.scale, saved.trainer.optimizer     # the module's and the trainer's state

`SparseAutoencoder.get_extra_state` writes `SAEState.to_dict()` and `load_state_dict` reads it
back; the dict's keys have not changed since the SAEs became modules, so those checkpoints load
as they are, and `module_layout` converts the layout from before ({"params": ..., "buffers": ...,
...}). Tensors, scalars and nested dicts only, so `torch.load(weights_only=True)` reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

EXTRA = "_extra_state"
"""The key of everything but the module's tensors in an SAE's state dict (torch's `get_extra_state`)."""


@dataclass
class WarmUp:
    """The warm-up of the input scale so far: the float64-accumulated sum of ||x||^2 and its rows."""

    sum_sq: float = 0.0
    rows: int = 0


@dataclass
class TrainerState:
    """What an `SAETrainer` keeps, enough to resume it bit for bit."""

    warm: WarmUp
    optimizer: dict[str, Any] | None
    """Adam's `state_dict()` (a copy), None before the first step."""
    generator: Tensor
    """The state of the generator the initialisation draws from."""
    mixer: dict[str, Any]
    """The mixing buffer's `state_dict()`: the buffered rows and its generator."""
    tracker: dict[str, Any]
    """The per-latent firing records (`LatentTracker.state_dict()`)."""
    running: dict[str, Any]
    """Steps, tokens and the running means of the step statistics (`RunningStats.state_dict()`)."""

    def to_dict(self) -> dict[str, Any]:
        return {"warm": [self.warm.sum_sq, self.warm.rows], "optimizer": self.optimizer, "generator": self.generator,
                "mixer": self.mixer, "tracker": self.tracker, "running": self.running}

    @classmethod
    def from_dict(cls, extra: Mapping[str, Any]) -> TrainerState:
        sum_sq, rows = extra["warm"]
        return cls(WarmUp(float(sum_sq), int(rows)), extra["optimizer"], extra["generator"], extra["mixer"],
                   extra["tracker"], extra["running"])


@dataclass
class SAEState:
    """Everything an SAE's state dict holds beside its tensors (under `EXTRA`)."""

    cls: str
    """The class's name (checked on load)."""
    config: dict[str, Any]
    """The config's JSON form (checked on load)."""
    seed: int
    d: int | None
    scale: float | None
    parameters: list[str]
    """Which of the tensors are parameters (the rest are buffers)."""
    trainer: TrainerState
    own: dict[str, Any] = dataclasses.field(default_factory=dict)
    """A variant's own entries (a transcoder's input width, a crosscoder's sites)."""

    def to_dict(self) -> dict[str, Any]:
        return {"class": self.cls, "config": self.config, "seed": self.seed, "d": self.d, "scale": self.scale,
                "parameters": list(self.parameters), **self.trainer.to_dict(), **self.own}

    @classmethod
    def from_dict(cls, extra: Mapping[str, Any], own: tuple[str, ...] = ()) -> SAEState:
        """The state in `extra`; `own` names the variant's entries to keep."""
        if "config" not in extra or "class" not in extra:
            raise ValueError("not an SAE state: expected a dict with 'class' and 'config' entries")
        return cls(extra["class"], extra["config"], extra.get("seed", 0), extra["d"], extra["scale"],
                   list(extra["parameters"]), TrainerState.from_dict(extra), {k: extra.get(k) for k in own})


def module_layout(state: Mapping[str, Any]) -> dict[str, Any]:
    """`state` in the module layout; a state written before the SAEs were modules (its parameters
    under "params", its buffers under "buffers", the rest beside them) is converted."""
    if not isinstance(state, Mapping) or ("params" not in state and EXTRA not in state):
        raise ValueError("not an SAE state: expected the dict of an SAE's state_dict()")
    if EXTRA in state:
        return dict(state)
    extra = {k: v for k, v in state.items() if k not in ("params", "buffers")}
    return {**state["params"], **state["buffers"], EXTRA: {**extra, "parameters": list(state["params"])}}
