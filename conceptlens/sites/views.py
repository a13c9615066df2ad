"""Views: each architecture idiom between a module's tensor and a site, as one small object.

A site is its module's tensor seen through an ordered tuple of views, the first nearest the
module: `hook_site` (hooks/points.py) registers one hook at the site's point and hands its
tensor through every view's `read`, in order, to the callback; an edit comes back through the
views' `write`, in reverse. A view that needs state per hook or hooks of its own (a counter, a
recorded length, another module's output) overrides `attach`, asking the hook layer for them
through `ViewHooks` (this layer imports no hooks).

    class TimeMajor(View):                       # the module's (T, B, ...) is the site's (B, T, ...)
        def read(self, x): return x.transpose(0, 1)
        def write(self, x, new): return new.transpose(0, 1)
        def describe(self): return "the module's tensor is time-major ..."

Order (`site_views` in adapters/readings.py builds it): the tap (Expansion, FusedPart, FlatRows or
Plus; or Heads), Scale, CallOf, StreamsFirst, TimeMajor, ChannelsFirst (then Heads), Routed,
Trim, FirstCall. Views carrying per-hook state: sites/stateful_views.py.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from torch import Tensor, nn

SiteFn = Callable[[Tensor], Tensor | None]


class Removable(Protocol):
    def remove(self) -> None: ...


Register = Callable[[SiteFn], Removable]
"""Registers a callback at the site's tensor as the views before this one give it."""


class Target(Protocol):
    """What a view's `attach` reads of its site (a `Site`; site.py imports this module)."""

    @property
    def name(self) -> str: ...

    @property
    def module(self) -> nn.Module: ...


class ViewHooks(Protocol):
    """What a view may ask of the hook layer (hooks/points.py gives it, on the model's HookManager)."""

    def pre_hook(self, module: Any, fn: Callable, *, prepend: bool = False, with_kwargs: bool = False) -> Removable:
        ...

    def forward_hook(self, module: Any, fn: Callable, *, prepend: bool = False) -> Removable: ...

    def group(self, *steps: Callable[[], Removable]) -> Removable:
        """Run each registration step in order; one handle for all (removed if a later step fails)."""
        ...

    def gated(self, block: Any, stack: Any, call: int, fn: SiteFn, register: Register) -> Removable:
        """`register(g)`, g running `fn` only in the `call`-th call of `block` per forward of `stack`."""
        ...

    def routed(self, module: Any) -> Removable:
        """While kept, direct `module.forward(...)` calls run its hooks."""
        ...

    def streams(self, module: Any, expansion: Any) -> Any:
        """The shared per-call state of `module`'s output spread over streams (hooks/hyper.py)."""
        ...

    def key_layout(self, module: Any, kind: str) -> Removable:
        """Declare that `module`'s attention calls attend to their tokens' keys followed by others."""
        ...


class View:
    """One idiom: `read` the site from the module's tensor, `write` an edit back, `describe` it."""

    def read(self, x: Tensor) -> Tensor:
        return x

    def write(self, x: Tensor, new: Tensor) -> Tensor:
        """The module's tensor for the site's `new` value (`x`: the module's tensor as it was)."""
        return new

    def describe(self) -> str:
        """Words for the site's description ("" for none)."""
        return ""

    def wrap(self, fn: SiteFn) -> SiteFn:
        """`fn`, taking the site's tensor, as a callback on the module's tensor."""
        def call(x: Tensor) -> Tensor | None:
            new = fn(self.read(x))
            return None if new is None else self.write(x, new)

        return call

    def attach(self, hooks: ViewHooks, site: Target, fn: SiteFn, register: Register) -> Removable:
        """Register `fn` (on the site's tensor) through `register` (on the tensor before this view)."""
        return register(self.wrap(fn))

    def __repr__(self) -> str:
        return type(self).__name__ + "()"


class Heads(View):
    """A projection's `(..., H * d)` is the site's `(..., H, d)`."""

    def __init__(self, n: int) -> None:
        self.n = n

    def read(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.n, -1))

    def write(self, x: Tensor, new: Tensor) -> Tensor:
        return new.flatten(-2)

    def __repr__(self) -> str:
        return f"Heads({self.n})"


class FusedPart(View):
    """One part (q, k or v) of a fused projection's output, split into heads (adapters/fused.py);
    an edit goes back into that part and leaves the others as they were."""

    def __init__(self, part: Any, heads: int) -> None:
        self.part, self.heads = part, heads

    def read(self, x: Tensor) -> Tensor:
        return self.part.take(x).unflatten(-1, (self.heads, -1))

    def write(self, x: Tensor, new: Tensor) -> Tensor:
        return self.part.put(x, new.flatten(-2))

    def __repr__(self) -> str:
        return f"FusedPart({self.part}, heads={self.heads})"


class Scale(View):
    """The site is `factor` times the module's output: what a block that scales a sublayer's output
    (a residual multiplier; a per-channel `(d,)` rate) adds to the residual. An edit comes back as
    x + (edited - factor * x) / factor, so a null edit returns x bit for bit."""

    def __init__(self, factor: float | Tensor) -> None:
        self.factor = factor

    def _factor(self, x: Tensor) -> float | Tensor:
        return self.factor.to(x) if isinstance(self.factor, Tensor) else self.factor

    def read(self, x: Tensor) -> Tensor:
        return x * self._factor(x)

    def write(self, x: Tensor, new: Tensor) -> Tensor:
        factor = self._factor(x)
        return x + (new - x * factor) / factor

    def __repr__(self) -> str:
        what = f"tensor{tuple(self.factor.shape)}" if isinstance(self.factor, Tensor) else f"{self.factor:g}"
        return f"Scale({what})"


class StreamsFirst(View):
    """The model's `(n, B, T, d)` residual, n streams first (Gemma 3n's AltUp), is the site's
    `(B, T, n, d)`; a tensor of another rank at the same module passes through."""

    def read(self, x: Tensor) -> Tensor:
        return x.permute(1, 2, 0, 3) if x.ndim == 4 else x

    def write(self, x: Tensor, new: Tensor) -> Tensor:
        return new.permute(2, 0, 1, 3) if x.ndim == 4 else new

    def describe(self) -> str:
        return "the residual is several streams first, (n, B, T, d) in the model: the site is (B, T, n, d)"


class TimeMajor(View):
    """The module's `(T, B, ...)` (FSMT's blocks) is the site's `(B, T, ...)`."""

    def read(self, x: Tensor) -> Tensor:
        return x.transpose(0, 1)

    def write(self, x: Tensor, new: Tensor) -> Tensor:
        return new.transpose(0, 1)

    def describe(self) -> str:
        return "the module's tensor is time-major (T, B, ...), the site is its (B, T, ...) transpose"


class ChannelsFirst(View):
    """The module's `(B, C, T)` (SqueezeBERT's 1x1 convolutions) is the site's `(B, T, C)`; an edit
    comes back contiguous."""

    def read(self, x: Tensor) -> Tensor:
        return x.transpose(1, 2)

    def write(self, x: Tensor, new: Tensor) -> Tensor:
        return new.transpose(1, 2).contiguous()

    def describe(self) -> str:
        return "the module's tensor is channels-first (B, C, T), the site is its (B, T, C) transpose"
