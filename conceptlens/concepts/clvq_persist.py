"""Checkpoints and replica averaging for CLVQTranscoder (kept apart from the training steps).

    state = transcoder_state(tc)             # what tc.state_dict() returns
    load_transcoder_state(fresh_tc, state)   # what tc.load_state_dict(state) does after its checks
    merge_transcoders(tc, other)             # what tc.merge(other) does
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from conceptlens.concepts.clvq_config import TranscoderParts

if TYPE_CHECKING:
    from conceptlens.concepts.clvq import CLVQTranscoder


def transcoder_state(tc: CLVQTranscoder) -> dict[str, Any]:
    """Everything needed to resume bit for bit: parameters, Adam moments, the codebook."""
    state: dict[str, Any] = {"config": tc.config_dict(), "steps": tc.steps,
                             "vq": tc.vq.state_dict(), "parts": None,
                             "mixer": None if tc._mixer is None else tc._mixer.state_dict()}
    if (parts := tc.parts) is not None:
        state["parts"] = {"dims": parts.dims, "encoder": parts.encoder.state_dict(),
                          "decoder": parts.decoder.state_dict(),
                          "optimizer": parts.optimizer.state_dict(),
                          "pending": parts.pending, "fvu": parts.fvu, "scales": parts.scales}
    return copy.deepcopy(state)


def load_transcoder_state(tc: CLVQTranscoder, state: dict[str, Any]) -> None:
    """Restore `transcoder_state` (checked and placed by the caller) into `tc`."""
    tc.vq.load_state_dict(state["vq"])
    tc.steps = state["steps"]
    if tc._mixer is not None:
        tc._mixer.load_state_dict(state["mixer"])
    saved = state["parts"]
    if saved is None:
        tc.parts = None
        return
    parts = tc.parts = tc._build(tuple(saved["dims"]), saved["fvu"].device)
    parts.encoder.load_state_dict(saved["encoder"])
    parts.decoder.load_state_dict(saved["decoder"])
    parts.optimizer.load_state_dict(saved["optimizer"])
    parts.pending = [p.clone() for p in saved["pending"]]
    parts.fvu = saved["fvu"].clone()
    parts.scales = {k: v.clone() for k, v in saved["scales"].items()}


@torch.no_grad()
def merge_transcoders(tc: CLVQTranscoder, other: CLVQTranscoder) -> None:
    """What `tc.merge(other)` does; see `CLVQTranscoder._merge`."""
    if other.parts is None:
        return
    if tc.parts is None or not tc.vq.is_initialised:
        tc.load_state_dict(other.state_dict())
        return
    mine, theirs = tc.parts, other.parts
    if not other.vq.is_initialised:
        raise ValueError("cannot merge a transcoder that has not initialised into one that has")
    if mine.dims != theirs.dims or any(not torch.equal(mine.scales[k], theirs.scales[k].to(mine.fvu.device))
                                       for k in mine.scales):
        raise ValueError("replicas must start from one initialised state (load the same state_dict); "
                         f"got widths {mine.dims} and {theirs.dims} or different standardisations")
    _average_modules(mine, theirs)
    tc.vq.merge(other.vq)
    mine.fvu = (mine.fvu + theirs.fvu.to(mine.fvu.device)) / 2
    tc.steps = max(tc.steps, other.steps)
    mine.pending = [torch.cat([p, q.to(p.device)]) for p, q in zip(mine.pending, theirs.pending)]
    rows = None if other._mixer is None else other._mixer.state_dict()["data"]
    if rows is not None and len(rows) and tc._mixer is not None:
        tc._mixer.add(rows)


def _average_modules(mine: TranscoderParts, theirs: TranscoderParts) -> None:
    """Equal-weight average of encoder and decoder parameters and their Adam moments, into `mine`."""
    ps = [*mine.encoder.parameters(), *mine.decoder.parameters()]
    qs = [*theirs.encoder.parameters(), *theirs.decoder.parameters()]
    for p, q in zip(ps, qs):
        p.add_(q.to(p.device)).mul_(0.5)
        a, b = mine.optimizer.state.get(p), theirs.optimizer.state.get(q)
        if a and b:
            for key in ("exp_avg", "exp_avg_sq"):
                a[key].add_(b[key].to(p.device)).mul_(0.5)
            a["step"] = torch.maximum(a["step"], b["step"].to(a["step"].device))
