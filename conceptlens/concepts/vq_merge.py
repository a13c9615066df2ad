"""Merging VQ codebooks: the EMA statistics of data-parallel replicas added, as states.

    vq.merge(other)    # = vq.load_state(merge_codebooks(vq.state(), other.state(), decay, eps))

A merge adds what the other codebook learnt since the state both started from (their shared
start: the initialisation, the last merge, or the state on which `mark_shared_start()` was
called before its `state_dict` was handed to the replicas): EMA counts, EMA sums, FVU sums,
hits and tokens of the other, minus its decayed copy of the shared start, are added to this
one's, so the shared start is counted once. After one step each, the merge equals one step on
both batches (exact, tested); after more it is the count-weighted mean of the workers' codes.
Codebooks without a common start are added code by code (code i must mean the same on both
sides, which only a shared start guarantees). Rows still in the other's mixing buffer join
this one's. An empty codebook becomes a copy of the other (keeping its own buffered rows).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from conceptlens.concepts.vq_config import SharedStart, VQState
from conceptlens.concepts.vq_math import codes_from_ema


def merge_codebooks(mine: VQState, theirs: VQState, decay: float, eps: float) -> VQState:
    """The state of `mine` with `theirs` merged into it (both copies: `mine` is changed)."""
    if theirs.fitted is None:
        return mine
    mixer = joined_rows(mine.mixer, theirs.mixer)
    if mine.fitted is None:
        return replace(theirs, mixer=mixer)
    a, b = mine.fitted, theirs.fitted
    start, own = theirs.origin, mine.origin
    if start is None or own is None or not all(
            torch.equal(getattr(start, k), getattr(own, k)) for k in ("counts", "sums", "hits")):
        start = None  # no start both share
    dev = a.counts.device
    if start is not None:  # subtract the other's decayed copy of the start both share
        w = decay ** (theirs.steps - start.steps)
        a.counts = a.counts + b.counts.to(dev) - w * start.counts.to(dev)
        a.sums = a.sums + b.sums.to(dev) - w * start.sums.to(dev)
        a.fvu = a.fvu + b.fvu.to(dev) - w * start.fvu.to(dev)
        a.hits = a.hits + b.hits.to(dev) - start.hits.to(dev)
        tokens = mine.tokens + theirs.tokens - start.tokens
    else:
        a.counts, a.sums = a.counts + b.counts.to(dev), a.sums + b.sums.to(dev)
        a.hits, a.fvu = a.hits + b.hits.to(dev), a.fvu + b.fvu.to(dev)
        tokens = mine.tokens + theirs.tokens
    a.codes = codes_from_ema(a.counts, a.sums, eps)
    steps = max(mine.steps, theirs.steps)
    return replace(mine, steps=steps, tokens=tokens, origin=SharedStart.of(a, steps, tokens), mixer=mixer)


def joined_rows(mine: dict[str, Any] | None, theirs: dict[str, Any] | None) -> dict[str, Any] | None:
    """A mixing buffer's `state_dict()` with the rows of another's added after its own, as
    `MixingBuffer.add` stores them (None: no buffer, nothing to add to)."""
    rows = None if theirs is None else theirs["data"]
    if mine is None or rows is None or not len(rows):
        return mine
    data = mine["data"]
    return {**mine, "data": rows if data is None else torch.cat([data, rows.to(data.device, data.dtype)])}
