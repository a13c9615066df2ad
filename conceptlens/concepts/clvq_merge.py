"""Merging CLVQ transcoders: data-parallel replicas averaged, as states.

    tc.merge(other)    # = tc.load_state(merge_transcoders(tc.state(), other.state(), decay, eps))

Replicas started from one initialised state (the same `state_dict`): encoder and decoder
parameters and Adam moments are averaged with equal weights, the codebooks merge as
`VQCodebook.merge` (the shared start counted once), the step count is the larger one and
buffered rows join. A transcoder that has not started takes the other's state; rows waiting
for the initialisation on either side are fed afterwards by `CLVQTranscoder.merge`, so none is
dropped. Across processes the fit all-reduces gradients every step instead.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from conceptlens.concepts.clvq_config import CLVQState
from conceptlens.concepts.vq_merge import joined_rows, merge_codebooks


def merge_transcoders(mine: CLVQState, theirs: CLVQState, decay: float, eps: float) -> CLVQState:
    """The state of `mine` with the replica `theirs` merged into it (both copies: `mine` is changed)."""
    if theirs.parts is None:
        return mine
    if mine.parts is None or mine.vq.fitted is None:
        return theirs
    a, b = mine.parts, theirs.parts
    if theirs.vq.fitted is None:
        raise ValueError("cannot merge a transcoder that has not initialised into one that has")
    dev = a.fvu.device
    if a.dims != b.dims or any(not torch.equal(a.scales[k], b.scales[k].to(dev)) for k in a.scales):
        raise ValueError("replicas must start from one initialised state (load the same state_dict); "
                         f"got widths {a.dims} and {b.dims} or different standardisations")
    parts = replace(a, encoder=_mean(a.encoder, b.encoder), decoder=_mean(a.decoder, b.decoder),
                    optimizer=_mean_moments(a.optimizer, b.optimizer), fvu=(a.fvu + b.fvu.to(dev)) / 2,
                    pending=[torch.cat([p, q.to(p.device)]) for p, q in zip(a.pending, b.pending)])
    return CLVQState(max(mine.steps, theirs.steps), merge_codebooks(mine.vq, theirs.vq, decay, eps), parts,
                     joined_rows(mine.mixer, theirs.mixer))


def _mean(mine: dict[str, Tensor], theirs: dict[str, Tensor]) -> dict[str, Tensor]:
    """Equal-weight average of two modules' parameters (their state dicts: the modules hold no buffers)."""
    return {k: v.add_(theirs[k].to(v.device)).mul_(0.5) for k, v in mine.items()}


def _mean_moments(mine: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Adam's state dict with the moments of each parameter both have averaged and the larger step."""
    for i, a in mine["state"].items():
        b = theirs["state"].get(i)
        if a and b:
            for key in ("exp_avg", "exp_avg_sq"):
                a[key].add_(b[key].to(a[key].device)).mul_(0.5)
            a["step"] = torch.maximum(a["step"], b["step"].to(a["step"].device))
    return mine
