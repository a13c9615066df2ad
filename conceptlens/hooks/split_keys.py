"""Which keys of an attention call are this forward's tokens, for calls that attend to more.

A module registered with a key layout (adapters/keys.py; the layout is kept in its HookManager's
`key_layouts`) attends to [its tokens' keys;
others]: "stack", the other stack's tokens (T5Gemma2's merged self- and cross-attention);
"appended", entries a submodule returns (DeepSeek V4's compressed KV). Its q/k/v hooks then
act on rows [lo, hi) of the keys:

- the own part (current=True): without a cache, the first T (this forward's tokens); with one,
  ("stack") the keys the self-attention cache returned, whose last T are this forward's;
- the other stack's part (current=False, "stack" only): every key after the own part.
"""

from __future__ import annotations

from torch import Tensor, nn

from conceptlens.hooks.kv_cache import CallState


def own_length(module: nn.Module, layout: str, length: int, state: CallState | None) -> int | None:
    """Number of keys, from the first, that belong to the module's own stack in this call (None:
    not a split module (`layout` ""), or an "appended" one under a cache, whose k/v hooks refuse it)."""
    if not layout:
        return None
    if state is None or not state.cached:
        return length
    returned = state.parts.get("self")
    if layout == "appended":
        return None
    if not returned:
        raise ValueError(f"{type(module).__name__} attends to its own keys followed by others, but this call's "
                         "cache did not tell which are its own, so its q/k/v sites cannot be split; run with "
                         "use_cache=False")
    return int(returned[0].shape[2])


def rows(own: int, length: int, total: int, current: bool) -> tuple[int, int]:
    """[lo, hi) of the keys a k/v hook sees: this forward's tokens of the own part, or the rest."""
    return (own - length, own) if current else (own, total)


def ran_at_update(state: CallState, current: bool) -> bool:
    """A k/v hook of this part already ran on the keys its cache stored in this call."""
    return ("self" if current else "cross") in state.parts


def part_of(pattern: Tensor, own: int, current: bool, layout: str) -> Tensor:
    """The pattern's columns of one part ("stack"); every column otherwise."""
    if layout != "stack":
        return pattern
    return pattern[..., :own] if current else pattern[..., own:]
