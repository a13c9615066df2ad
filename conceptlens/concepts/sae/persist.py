"""Checkpoints and replica averaging for SparseAutoencoder (kept apart from the training loop).

    state = training_state(sae)             # what sae.state_dict() returns
    load_training_state(fresh_sae, state)   # resumes bit for bit
    average_replicas(sae, other_replica)    # what sae.merge(other) does

An SAE's state is its module state dict: parameters and buffers by name, and the rest of the
training state under "_extra_state" (torch's `get_extra_state`). States written before the
SAEs became modules, {"params": ..., "buffers": ..., ...}, are read too (`module_layout`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from conceptlens.concepts.sae.stats import LatentTracker

if TYPE_CHECKING:
    from conceptlens.concepts.sae.base import SparseAutoencoder


EXTRA = "_extra_state"
"""The key of everything but the module's tensors in an SAE's state dict (torch's `get_extra_state`)."""


def training_state(sae: SparseAutoencoder) -> dict[str, Any]:
    """What `sae.state_dict()` returns: the module's parameters and buffers by name and, under
    `_extra_state`, `extra_state(sae)`. Tensors, scalars and nested dicts only, so
    `torch.load(weights_only=True)` reads it."""
    return {**{k: v.detach().clone() for k, v in sae.params.items()},
            **{k: v.clone() for k, v in sae.buffer_dict.items()}, EXTRA: extra_state(sae)}


def extra_state(sae: SparseAutoencoder) -> dict[str, Any]:
    """The training state beside the module's tensors: config, warm-up, optimiser, buffered rows, RNG,
    statistics, and which of the tensors are parameters (the rest are buffers)."""
    return {
        "class": type(sae).__name__,
        "config": sae.config.to_json(),
        "seed": sae.seed,
        "d": sae.d,
        "scale": sae.scale,
        "warm": list(sae._warm),
        "parameters": list(sae.params),
        # deep copy: Adam's state_dict shares its moment tensors with the live optimiser
        "optimizer": None if sae._opt is None else copy.deepcopy(sae._opt.state_dict()),
        "generator": sae._gen.get_state(),
        "mixer": sae._mixer.state_dict(),
        "tracker": sae._tracker.state_dict(),
        "running": sae._running.state_dict(),
    }


def module_layout(state: Mapping[str, Any]) -> dict[str, Any]:
    """`state` in the module layout; a state written before the SAEs were modules (its parameters
    under "params", its buffers under "buffers", the rest beside them) is converted."""
    if not isinstance(state, Mapping) or ("params" not in state and EXTRA not in state):
        raise ValueError("not an SAE state: expected the dict of an SAE's state_dict()")
    if EXTRA in state:
        return dict(state)
    extra = {k: v for k, v in state.items() if k not in ("params", "buffers")}
    return {**state["params"], **state["buffers"], EXTRA: {**extra, "parameters": list(state["params"])}}


def load_training_state(sae: SparseAutoencoder, state: Mapping[str, Any]) -> None:
    """Restore `training_state` into an SAE constructed with the same class and config."""
    state = module_layout(state)
    extra = state[EXTRA]
    if extra.get("class") != type(sae).__name__:
        raise ValueError(f"state is for a {extra.get('class')!r}; this is a {type(sae).__name__!r}")
    sae.check_state(extra)
    sae.seed, sae.d, sae.scale, sae._warm = extra["seed"], extra["d"], extra["scale"], list(extra["warm"])
    names = extra["parameters"]
    sae.params = {k: state[k].clone().requires_grad_(True) for k in names}
    sae.buffer_dict = {k: v.clone() for k, v in state.items() if k != EXTRA and k not in names}
    if sae.params:
        sae._device = next(iter(sae.params.values())).device
    sae._opt = None  # (a set rebuilt from its concepts has parameters and no optimiser yet)
    if sae.params and extra["optimizer"] is not None:
        sae._opt = torch.optim.Adam(list(sae.params.values()), lr=sae.config.learning_rate(), betas=sae.config.betas)
        sae._opt.load_state_dict(copy.deepcopy(extra["optimizer"]))
    sae._gen.set_state(extra["generator"])
    sae._mixer.load_state_dict(extra["mixer"])
    sae._tracker = LatentTracker(sae.config.width, sae.config.dead_after, sae._device)
    sae._tracker.load_state_dict(extra["tracker"])
    sae._running.load_state_dict(extra["running"])


@torch.no_grad()
def merge_replicas(sae: SparseAutoencoder, other: SparseAutoencoder) -> None:
    """What `sae.merge(other)` does; see `SparseAutoencoder._merge`."""
    if other.config != sae.config:
        raise ValueError(f"replicas need the same config; got {other.config} and {sae.config}")
    if other.d is None:
        return  # it has seen nothing
    if sae.d is not None and other.d != sae.d:
        raise ValueError(f"cannot merge an SAE of width d={other.d} into one of width d={sae.d}")
    mine = sae._mixer.state_dict()["data"]
    if not sae.params and other.params:  # this one has not started: take the other's state
        load_training_state(sae, training_state(other))
        if mine is not None and len(mine):
            sae._mixer.add(mine.to(sae._mixer.device))
        return
    theirs = other._mixer.state_dict()["data"]
    if sae.params and other.params:
        average_replicas(sae, other)
    elif not sae.params and not other.params and sae.scale is None:  # both warming up: pool the warm-up sums
        sae.d = other.d
        sae._warm = [sae._warm[0] + other._warm[0], sae._warm[1] + other._warm[1]]
        if other.scale is not None or sae._warm[1] >= sae.config.warmup_tokens:
            sae.scale = other.scale if other.scale is not None else None
            if sae.scale is None:
                sae._set_scale()
    elif other.scale != sae.scale:
        raise ValueError(f"replicas must share the input width and warm-up scale (start them from one state_dict); "
                         f"got d={sae.d}, scale={sae.scale} and d={other.d}, scale={other.scale}")
    if theirs is not None and len(theirs):  # the other's buffered rows join this buffer
        sae._mixer.add(theirs.to(sae._mixer.device))


@torch.no_grad()
def average_replicas(sae: SparseAutoencoder, other: SparseAutoencoder) -> None:
    """Equal-weight average of parameters, buffers and Adam moments of two replicas, into `sae`.

    Firing counts and trained tokens add (after averaging, a replica that reloads the merged
    state has both histories, so frequencies stay fractions); the step count is the larger
    one, the same as Adam's step, since replicas step in parallel.
    """
    if type(other) is not type(sae):
        raise TypeError(f"can only merge a {type(sae).__name__} with another; got {type(other).__name__}")
    if not sae.params or not other.params:
        raise ValueError("both replicas must have taken an optimiser step before they can be averaged")
    if other.scale != sae.scale or other.d != sae.d:
        raise ValueError(f"replicas must share the input width and warm-up scale (start them from one state_dict); "
                         f"got d={sae.d}, scale={sae.scale} and d={other.d}, scale={other.scale}")
    for name, p in sae.params.items():
        q = other.params[name]
        p.add_(q.to(p.device)).mul_(0.5)
        mine, theirs = sae._optimiser().state[p], other._optimiser().state[q]
        for key in ("exp_avg", "exp_avg_sq"):
            mine[key].add_(theirs[key].to(p.device)).mul_(0.5)
        mine["step"] = torch.maximum(mine["step"], theirs["step"].to(mine["step"].device))
    for name, b in sae.buffer_dict.items():
        if b.is_floating_point():
            b.add_(other.buffer_dict[name].to(b.device)).mul_(0.5)
    if sae.unit_decoder:
        W = sae.params["W_dec"]
        W /= W.norm(dim=1, keepdim=True).clamp(min=1e-12)
    sae._tracker.merge(other._tracker)
    sae._running.merge(other._running)
