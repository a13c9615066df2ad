"""Site: a named place in a model where an activation can be read or edited.

The lowest layer of the hook stack: `adapters/` finds sites, `hooks/` reads and edits them;
this module imports neither."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeVar

from torch import nn

from conceptlens.sites.views import View

Point = Literal["input", "output", "q", "k", "v", "pattern"]
V = TypeVar("V", bound=View)


@dataclass(frozen=True, eq=False)
class Site:
    """One site of DESIGN.md's table, bound to the module that produces it.

    `point` says how the tensor is reached: the block's `input` (forward pre-hook), a
    module's `output` (forward hook; first element of a tuple), or `q`/`k`/`v` as passed to
    the model's attention function. Its `views` turn that tensor into the site's layout, e.g. a
    projection output `(B, T, heads * head_dim)` into `(B, T, heads, head_dim)`.
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
    views: tuple[View, ...] = ()
    """How the site is seen in the module's tensor, the first view nearest the module (sites/views.py):
    e.g. `(Heads(8),)` for a projection read per head, `(TimeMajor(),)` for FSMT's blocks."""

    def find(self, kind: type[V]) -> V | None:
        """The site's first view of class `kind` (None: it has none)."""
        return next((v for v in self.views if isinstance(v, kind)), None)

    @property
    def width(self) -> int:
        """Size of the last dimension (hidden size, or head dimension for q/k/v)."""
        return int(self.shape[-1])

    def describe(self) -> str:
        dims = ", ".join(str(s) for s in self.shape)
        return f"{self.name}: ({dims}) - {self.source}"

    def __repr__(self) -> str:
        views = ", ".join(map(repr, self.views))
        return f"Site({self.describe()}; views=({views}))"
