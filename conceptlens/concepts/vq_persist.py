"""Checkpoints and merging for VQCodebook (kept apart from the training steps).

    state = codebook_state(vq)             # what vq.state_dict() returns
    load_codebook_state(fresh_vq, state)   # what vq.load_state_dict(state) does after its checks
    merge_codebooks(vq, other)             # what vq.merge(other) does
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from conceptlens.concepts.vq_config import CodebookState
from conceptlens.concepts.vq_math import codes_from_ema

if TYPE_CHECKING:
    from conceptlens.concepts.vq import VQCodebook


def codebook_state(vq: VQCodebook) -> dict[str, Any]:
    """Everything needed to resume bit for bit (tensors, ints, the generator state)."""
    fitted = None if vq.fitted is None else {k: v.clone() for k, v in asdict(vq.fitted).items()}
    pending = None if vq._pending is None else vq._pending.clone()
    return {"config": vq.config_dict(), "d": vq.d, "fitted": fitted, "pending": pending,
            "init_calls": vq._init_calls, "steps": vq.steps, "tokens": vq.tokens,
            "generator": vq._gen.get_state(), "origin": _copy(vq._origin),
            "mixer": None if vq._mixer is None else vq._mixer.state_dict()}


def load_codebook_state(vq: VQCodebook, state: dict[str, Any]) -> None:
    """Restore `codebook_state` (checked and placed by the caller) into `vq`."""
    fitted = state["fitted"]
    vq.fitted = None if fitted is None else CodebookState(**{k: v.clone() for k, v in fitted.items()})
    vq._pending = None if state["pending"] is None else state["pending"].clone()
    vq.d, vq._init_calls = state["d"], state["init_calls"]
    vq.steps, vq.tokens = state["steps"], state["tokens"]
    vq._gen.set_state(state["generator"])
    if vq._mixer is not None:
        vq._mixer.load_state_dict(state["mixer"])
    vq._origin = _copy(state.get("origin"))


def merge_codebooks(vq: VQCodebook, other: VQCodebook) -> None:
    """Add another worker's EMA statistics into `vq` (see the `VQCodebook` docstring)."""
    if other.config.n_codes != vq.config.n_codes or (vq.d and other.d and other.d != vq.d):
        raise ValueError(f"cannot merge a codebook of {other.config.n_codes} codes of width "
                         f"{other.d} into one of {vq.config.n_codes} codes of width {vq.d}")
    if other.fitted is None:
        return
    if vq.fitted is None:  # an empty codebook becomes a copy (keeping its own buffered rows)
        vq.load_state_dict({**other.state_dict(), "mixer": None if vq._mixer is None else vq._mixer.state_dict()})
        _join_buffer(vq, other)
        return
    mine, theirs, decay = vq.fitted, other.fitted, vq.config.decay
    origin, own_origin = other._origin, vq._origin
    if origin is None or own_origin is None or not all(
            torch.equal(origin[k], own_origin[k]) for k in ("counts", "sums", "hits")):
        origin = None  # no start both share
    if origin is not None:  # subtract the other's decayed copy of the start both share
        w = decay ** (other.steps - origin["steps"])
        dev = mine.counts.device
        mine.counts = mine.counts + theirs.counts.to(dev) - w * origin["counts"].to(dev)
        mine.sums = mine.sums + theirs.sums.to(dev) - w * origin["sums"].to(dev)
        mine.fvu = mine.fvu + theirs.fvu.to(dev) - w * origin["fvu"].to(dev)
        mine.hits = mine.hits + theirs.hits.to(dev) - origin["hits"].to(dev)
        vq.tokens += other.tokens - origin["tokens"]
    else:
        dev = mine.counts.device
        mine.counts, mine.sums = mine.counts + theirs.counts.to(dev), mine.sums + theirs.sums.to(dev)
        mine.hits, mine.fvu = mine.hits + theirs.hits.to(dev), mine.fvu + theirs.fvu.to(dev)
        vq.tokens += other.tokens
    mine.codes = codes_from_ema(mine.counts, mine.sums, vq.config.eps)
    vq.steps = max(vq.steps, other.steps)
    vq._mark_origin()
    _join_buffer(vq, other)


def _join_buffer(vq: VQCodebook, other: VQCodebook) -> None:
    rows = None if other._mixer is None else other._mixer.state_dict()["data"]
    if rows is not None and len(rows) and vq._mixer is not None:
        vq._mixer.add(rows)


def _copy(origin: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if origin is None else {k: v.clone() if isinstance(v, Tensor) else v for k, v in origin.items()}
