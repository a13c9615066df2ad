"""Attention over depth (attention residuals, Inkling 2): modules that mix layers, not tokens.

Inkling 2's blocks do not read the residual directly: before each sublayer a small module
attends, at every position, over the states of earlier layers (the block states the stack keeps)
and the residual, with learned queries, and the sublayer reads that mix. Such a module calls the
attention function with the positions in the heads' place (heads == T) and a few queries (not
T), and it has no projections (its queries are parameters): it is no sublayer of the block and
its calls are no attention over tokens. The block itself still adds its sublayers' outputs to
its input, or, at a block boundary, starts a new sum from them (the stack keeps its input as a
block state): `verify.repair` checks which. Per-query attention sinks join the pattern
(`hooks/pattern.py`). A block input that a later block is passed again: an edit there reaches
only its own block.
"""

from __future__ import annotations

import torch
from torch import nn

from conceptlens.adapters.probe_pass import Trace
from conceptlens.adapters.structure import BlockLayout

_KEYS = ("attn", "attn_out", "cross_attn", "cross_attn_out", "mixer_out", "mlp_out")


def depth_mixers(block: nn.Module, lay: BlockLayout, trace: Trace) -> set[nn.Module]:
    """Modules of the block that attend over depth; the layout keeps none of them as a sublayer."""
    x = trace.inputs.get(block)
    if x is None or x.ndim != 3:
        return set()
    inside = {m: n for n, m in block.named_modules() if n}
    found = {c.module for c in trace.attention if c.module in inside and c.heads == x.shape[1] != c.q_len
             and not any(isinstance(m, nn.Linear) for m in c.module.modules())}  # learned queries, no projections
    if not found:
        return found
    paths = {inside[m] for m in found}
    for key in _KEYS:
        path = getattr(lay, key)
        if path is not None and any(path == p or path.startswith(p + ".") for p in paths):
            setattr(lay, key, None)
    lay.style += (f", its sublayers read attention over depth ({', '.join(sorted(paths))}: the residual mixed "
                  "with earlier layers' states)")
    return found


def later_reads(blocks: list[nn.Module], trace: Trace) -> dict[int, int]:
    """Block i -> the first later block j that is passed block i's input again, as one of the
    earlier states it attends over (a (B, T, k, d) argument with that slice)."""
    found: dict[int, int] = {}
    for j, block in enumerate(blocks):
        states = [a for a in trace.args.get(block, ())[1:] if a is not None and a.ndim == 4]
        for i in range(j):
            x = trace.inputs.get(blocks[i])
            if i in found or x is None:
                continue
            if any(s.shape[:2] == x.shape[:2] and s.shape[-1] == x.shape[-1] and
                   any(torch.equal(s[..., k, :], x) for k in range(s.shape[-2])) for s in states):
                found[i] = j
    return found


def again_note(i: int, again: dict[int, int], prefix: str) -> str:
    """What a user editing block i's input must know when a later block reads it again."""
    if i not in again:
        return ""
    where = f"{prefix}blocks.{i - 1}.resid_out" if i else "the embedding's output"
    return (f"; {prefix}blocks.{again[i]} also attends over this tensor as the stack kept it, before this site's "
            f"hooks: an edit here changes this block only (edit {where} to change both)")
