"""Site: a named place in a model where an activation can be read or edited.

The lowest layer of the hook stack: `adapters/` finds sites, `hooks/` reads and edits them;
this module imports neither."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import Tensor, nn

Point = Literal["input", "output", "q", "k", "v", "pattern"]


@dataclass(frozen=True, eq=False)
class Expansion:
    """How a sublayer's output of width d enters a residual of n streams (width n * d), as in
    hyper-connections: the site is `(out[..., None, :] * w[..., :, None]).flatten(-2)`, w the
    (B, T, n) per-stream weights a gate module of the block returns (element `index` of its
    output); without the flatten where the residual is (B, T, n, d) (`flat` False). The residual
    with it added is read by `receiver`: at its input, which it passes on ("input"), at its input
    and again by the block, which adds it to its output ("both"), or it is the block's output
    ("output", `receiver` is the block). An edit's change is added there."""

    gate: nn.Module
    index: int
    receiver: nn.Module
    point: Literal["input", "output", "both"]
    flat: bool = True
    block: nn.Module | None = None


def spread(out: Tensor, weights: Tensor, flat: bool = True) -> Tensor:
    """A sublayer output (..., d) written to n streams with weights (..., n): (..., n * d), or
    (..., n, d) where the residual keeps its streams in a dimension of their own (HY-V4)."""
    both = out.unsqueeze(-2) * weights.unsqueeze(-1)
    return both.flatten(-2) if flat else both


@dataclass(frozen=True, eq=False)
class Site:
    """One site of DESIGN.md's table, bound to the module that produces it.

    `point` says how the tensor is reached: the block's `input` (forward pre-hook), a
    module's `output` (forward hook; first element of a tuple), or `q`/`k`/`v` as passed to
    the model's attention function. A projection output with `heads` set is viewed as
    `(B, T, heads, head_dim)`.
    """

    name: str
    """Canonical name, e.g. `blocks.3.resid_out` or `decoder.blocks.1.cross_attn.q`."""
    module: nn.Module
    """The module whose hook reads or edits the tensor."""
    point: Point
    shape: tuple[str | int, ...]
    """Symbolic shape: `("B", "T", 576)` or `("B", "T", 3, 64)`."""
    stack: str
    """Token space the rows belong to ("" for single-stack models, "encoder", "decoder")."""
    source: str
    """Where the tensor comes from, in words."""
    heads: int | None = None
    """For a projection read as q/k/v: number of heads to split the last dimension into."""
    flat_in: nn.Module | None = None
    """Set when `module` sees `(B * T, d)` rows: the block whose input gives (B, T)."""
    scale: float | Tensor = 1.0
    """The site is `scale` times the module's output: what a block that scales its sublayers'
    outputs (a residual multiplier; a per-channel `(d,)` rate) adds to the residual. Edits are
    mapped back exactly."""
    plus: nn.Module | tuple[nn.Module, ...] | None = None
    """The site is `module`'s output plus this module's (run beside it on the same input, e.g.
    a shared expert next to the routed ones), or these modules' (the block's other sublayers of
    that kind, run before it); edits change `module`'s output by their change."""

    call: int | None = None
    """Set when the block is one call of a layer module the stack runs several times in one
    forward (ALBERT's shared layer, a looped layer): the site is read and edited only during the
    `call`-th call (from 0) of `block` in each forward of `stack_module`."""
    block: nn.Module | None = None
    stack_module: nn.Module | None = None
    time_major: bool = False
    """The module's tensor is `(T, B, ...)` (FSMT's blocks); the site is its `(B, T, ...)` transpose."""
    part: object | None = None
    """A `fused.Part`: the site is that part of `module`'s output (q, k or v of a fused projection)."""
    trimmed: bool = False
    """The module sees the tokens padded inside the model (Longformer): the site is the first T,
    T = the length of this forward's input to `stack_module`."""
    expand: Expansion | None = None
    """Set when `module`'s output is spread over several residual streams (see Expansion)."""
    key_layout: str = ""
    """For q/k/v/pattern sites of a call whose keys are this forward's tokens followed by others
    (adapters/keys.py): "stack" (then the other stack's tokens: T5Gemma2's merged attention; a
    k/v site whose shape[1] is "S" is that part) or "appended" (entries a submodule returns)."""
    prefixed: bool = False
    """The module sees positions the model prepends to the tokens (CPM-Ant's prompt): the site is
    the last T, T as for `trimmed`."""
    channels_first: bool = False
    """The module's tensor is `(B, C, T)` (SqueezeBERT's 1x1 convolutions); the site is its `(B, T, C)` transpose."""
    row_offset: int = 0
    """The module runs on the block's rows padded by this many on both sides (PEGASUS-X's staggered
    attention): the site starts there."""
    first_call_in: nn.Module | None = None
    """The module runs more than once per call of this block (PEGASUS-X's FFN: on the tokens, then on
    its global tokens): the site is its first call in each call of the block."""
    routed: bool = False
    """The stack calls the module's `forward` directly (SqueezeBERT): while hooked, such calls go through its hooks."""

    streams_first: bool = False
    """The model's tensor is `(n, B, T, d)`, n residual streams first (Gemma 3n's AltUp); the site is
    its `(B, T, n, d)` permutation (a tensor of another rank at the same module passes through)."""

    @property
    def width(self) -> int:
        """Size of the last dimension (hidden size, or head dimension for q/k/v)."""
        return int(self.shape[-1])

    def describe(self) -> str:
        dims = ", ".join(str(s) for s in self.shape)
        return f"{self.name}: ({dims}) - {self.source}"

    def __repr__(self) -> str:
        return f"Site({self.describe()})"
