"""The views of one site, in the one order `hook_site` composes them (sites/views.py).

The adapter's readings of a site (found by the idiom files: padded.py, direct.py, fused.py,
keys.py, stream_writes.py, repair.py, residual.py, repeated.py, inner.py) become views, the
first nearest the module:

1. how the output is reached: `Expansion` (spread over streams), else `FusedPart`, else
   `FlatRows`, else `Plus` (an output point only; the first of them wins); `Heads` where a
   projection is read per head (not at q/k/v/pattern, which come per head);
2. `Scale`, 3. `CallOf` (one call of a shared layer, or of a module inside a sublayer),
4. `StreamsFirst`, 5. `TimeMajor`, 6. `ChannelsFirst` (then its `Heads`), 7. `Routed`,
8. `Trim`, 9. `FirstCall`; `SplitKeys` for q/k/v/pattern of an attention with extra keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from conceptlens.sites.hooked_views import CallOf, Expansion, FirstCall, FlatRows, Plus, Routed, SplitKeys, Trim
from conceptlens.sites.views import ChannelsFirst, FusedPart, Heads, Scale, StreamsFirst, TimeMajor, View


@dataclass
class Readings:
    """What the adapter found about one site, before it becomes views."""

    heads: int | None = None
    part: object | None = None
    expand: Expansion | None = None
    flat_in: nn.Module | None = None
    plus: nn.Module | tuple[nn.Module, ...] | None = None
    scale: float | Tensor = 1.0
    call: CallOf | None = None
    streams_first: bool = False
    time_major: bool = False
    channels_first: bool = False
    routed: nn.Module | None = None
    trim: Trim | None = None
    first_call_in: nn.Module | None = None


def _tap(point: str, r: Readings) -> list[View]:
    heads: list[View] = [Heads(r.heads)] if r.heads and not r.channels_first else []
    if point in ("q", "k", "v", "pattern"):
        return []
    if point == "input":
        return heads
    if r.expand is not None:
        return [r.expand]
    if r.part is not None and r.heads is not None:
        return [FusedPart(r.part, r.heads)]
    if r.flat_in is not None:
        return [FlatRows(r.flat_in)]
    if r.plus is not None:
        return heads + [Plus(r.plus if isinstance(r.plus, tuple) else (r.plus,))]
    return heads


def site_views(point: str, r: Readings) -> tuple[View, ...]:
    """The views for readings `r` of a site at `point`, in the order above."""
    views = _tap(point, r)
    if isinstance(r.scale, Tensor) or r.scale != 1.0:
        views.append(Scale(r.scale))
    if r.call is not None:
        views.append(r.call)
    views += [StreamsFirst()] if r.streams_first else []
    views += [TimeMajor()] if r.time_major else []
    if r.channels_first:
        views += [ChannelsFirst()] + ([Heads(r.heads)] if r.heads else [])
    views += [Routed(r.routed)] if r.routed is not None else []
    views += [r.trim] if r.trim is not None else []
    views += [FirstCall(r.first_call_in)] if r.first_call_in is not None else []
    return tuple(views)


def with_split_keys(views: tuple[View, ...], kind: str) -> tuple[View, ...]:
    """`views` of a q/k/v/pattern site of an attention whose keys run past its tokens (keys.py)."""
    return (SplitKeys(kind), *views)
