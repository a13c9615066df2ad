"""q/k/v of attention modules that compute all three with one projection and split it themselves.

Bloom, Falcon, MPT, GPT-1 and GPT-NeoX-Japanese write their own attention (no attention-function
interface) on the output of one fused `query_key_value` / `Wqkv` / `c_attn` projection. Their
q/k/v sites are *parts* of that output: its last dimension viewed as a grid, cut along one grid
axis. How each class lays the parts out is read from its own code (an exception table, like
families.py); tests check every layout against the model's eager attention weights.

Attention that does not call the attention-function interface gets q/k/v from its projections,
before any rotary embedding (the description says so), and no pattern site. Where the projections
sit one module below the attention module (GPT-Neo's `attn.attention`, MPNet, Perceiver, the
BigBird / LED encoders) that child owns them. Fused layouts: `(heads, 3, d)` interleaved for Bloom,
GPT-NeoX-Japanese and Falcon's one-k/v-per-head layout; `[q | k | v]` for MPT and GPT-1; Falcon's
multi-query `[h queries | k | v]` and grouped `(groups, h/g + 2, d)`. Each is tested against the
eager attention weights (softmax of the scores formed from the q/k parts with HF's own ALiBi or
rotary functions, and each head's output = weights @ v). An edit replaces only its part of the
projection output; a null edit is bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Part:
    """`x.unflatten(-1, grid)[..., start:stop along axis, ...]`, flattened back."""

    grid: tuple[int, ...]
    axis: int
    start: int
    stop: int

    def _dim(self) -> int:
        return self.axis - len(self.grid)

    def take(self, x: Tensor) -> Tensor:
        cut = x.unflatten(-1, self.grid).narrow(self._dim(), self.start, self.stop - self.start)
        return cut.flatten(-len(self.grid))

    def put(self, x: Tensor, new: Tensor) -> Tensor:
        """`x` with this part replaced by `new` (shaped as `take(x)`); other parts keep their values."""
        grid, dim = x.unflatten(-1, self.grid), self._dim()
        shape = list(self.grid)
        shape[self.axis] = self.stop - self.start
        pieces = [grid.narrow(dim, 0, self.start), new.to(x.dtype).unflatten(-1, tuple(shape)),
                  grid.narrow(dim, self.stop, self.grid[self.axis] - self.stop)]
        return torch.cat(pieces, dim).flatten(-len(self.grid))


@dataclass(frozen=True)
class Fused:
    projection: str
    """Child of the attention module that gives q, k and v in one output."""
    parts: dict[str, Part]
    heads: dict[str, int]
    head_dim: int
    rotary: bool
    """The module applies rotary embedding to q/k after the split (the parts are before it)."""


def _interleaved(heads: int, d: int) -> dict[str, Part]:  # (heads, 3, d): each head's q, k, v side by side
    return {w: Part((heads, 3, d), 1, i, i + 1) for i, w in enumerate("qkv")}


def _blocked(width: int) -> dict[str, Part]:  # [q | k | v]
    return {w: Part((3, width), 0, i, i + 1) for i, w in enumerate("qkv")}


class _FalconAttention(Protocol):
    """The attributes of transformers' FalconAttention that give its layout."""

    num_heads: int
    head_dim: int
    num_kv_heads: int
    new_decoder_architecture: bool
    multi_query: bool
    config: object


def _falcon(attn: _FalconAttention) -> Fused:
    h, d = attn.num_heads, attn.head_dim
    if attn.new_decoder_architecture:  # groups of (h / g queries, 1 key, 1 value)
        g = attn.num_kv_heads
        per = h // g
        parts = {"q": Part((g, per + 2, d), 1, 0, per), "k": Part((g, per + 2, d), 1, per, per + 1),
                 "v": Part((g, per + 2, d), 1, per + 1, per + 2)}
        kv = g
    elif attn.multi_query:  # [h queries | 1 key | 1 value]
        parts = {"q": Part((h + 2, d), 0, 0, h), "k": Part((h + 2, d), 0, h, h + 1),
                 "v": Part((h + 2, d), 0, h + 1, h + 2)}
        kv = 1
    else:
        parts, kv = _interleaved(h, d), h
    return Fused("query_key_value", parts, {"q": h, "k": kv, "v": kv}, d, not getattr(attn.config, "alibi", False))


def _even(projection: str, heads: int, d: int, parts: dict[str, Part], rotary: bool) -> Fused:
    return Fused(projection, parts, dict.fromkeys("qkv", heads), d, rotary)


_LAYOUTS = {
    # view(B, T, heads, 3, head_dim)
    "BloomAttention": lambda a: _even("query_key_value", a.num_heads, a.head_dim,
                                      _interleaved(a.num_heads, a.head_dim), False),
    "FalconAttention": _falcon,
    # chunk(3) of the last dimension
    "MptAttention": lambda a: _even("Wqkv", a.n_heads, a.head_dim, _blocked(a.n_heads * a.head_dim), False),
    # split(split_size): GPT-1
    "Attention": lambda a: _even("c_attn", a.n_head, a.split_size // a.n_head, _blocked(a.split_size), False)
    if hasattr(a, "c_attn") and hasattr(a, "split_size") else None,
    # view(B, T, heads, 3 * head_size), then [:d], [d:2d], [2d:]
    "GPTNeoXJapaneseAttention": lambda a: _even("query_key_value", a.num_attention_heads, a.head_size,
                                                _interleaved(a.num_attention_heads, a.head_size), True),
}


def fused_layout(attn: nn.Module) -> Fused | None:
    """How `attn` splits its fused projection, or None when it is not one of the known classes."""
    make = _LAYOUTS.get(type(attn).__name__)
    fused = make(attn) if make else None
    proj = getattr(attn, fused.projection, None) if fused else None
    width = getattr(proj, "out_features", None) or getattr(proj, "nf", None)  # Linear, or GPT-1's Conv1D
    if fused is None or width is None or any(width != _size(p.grid) for p in fused.parts.values()):
        return None
    return fused


def _size(grid: tuple[int, ...]) -> int:
    n = 1
    for g in grid:
        n *= g
    return n


def describe(fused: Fused, which: str) -> str:
    rotary = " (before the rotary embedding this attention applies after the split)" if fused.rotary and \
        which in "qk" else ""
    return f"{which} part of the fused {fused.projection} projection's output{rotary}; this attention does not use " \
        "the attention-function interface (no pattern site)"
