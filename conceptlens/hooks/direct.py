"""Blocks whose stack calls `block.forward(...)` directly, and blocks with channels-first tensors.

SqueezeBERT's encoder runs `layer.forward(hidden, mask, ...)`, which skips `nn.Module.__call__`,
so no hook on the layer ever runs. While a hook needs it, `route_through_call(module)` sets an
instance `forward` that sends a direct call through `module(...)` (hooks run, then the class's
forward); a call that already came through `__call__` goes straight to the real forward. The
last handle restores the instance exactly as it was (an instance `forward` set by someone else,
e.g. accelerate, is kept and called).

    handle = route_through_call(block)   # block.forward(...) now runs block's hooks
    handle.remove()

`channels_last(fn, heads)` gives `fn` the `(B, T, C)` (or `(B, T, H, d_head)`) view of a
channels-first `(B, C, T)` tensor and hands its edit back in the module's layout.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor, nn

from conceptlens.hooks.handles import Handle, HandleGroup

_MISSING = object()


class _Route:
    def __init__(self, module: nn.Module) -> None:
        self.module, self.refs, self.depth = module, 0, 0
        self.saved = module.__dict__.get("forward", _MISSING)
        inner = self.saved if self.saved is not _MISSING else type(module).forward.__get__(module)
        self.inner = inner
        self.group = HandleGroup()
        try:  # depth > 0 while `__call__` runs this module: its forward call then goes straight through
            self.group.add(module.register_forward_pre_hook(self._enter, prepend=True))
            self.group.add(module.register_forward_hook(self._leave, always_call=True))
        except BaseException:
            self.group.remove()
            raise
        module.forward = self.forward

    def _enter(self, module, args) -> None:
        self.depth += 1

    def _leave(self, module, args, output) -> None:
        self.depth = max(self.depth - 1, 0)

    def forward(self, *args, **kwargs):
        if self.depth:
            return self.inner(*args, **kwargs)
        return self.module(*args, **kwargs)

    def restore(self) -> None:
        if self.module.__dict__.get("forward") == self.forward:
            if self.saved is _MISSING:
                del self.module.__dict__["forward"]
            else:
                self.module.forward = self.saved
        self.group.remove()


_routes: dict[nn.Module, _Route] = {}


def route_through_call(module: nn.Module) -> Handle:
    """While the handle lives, a direct `module.forward(...)` call runs the module's hooks."""
    route = _routes.get(module)
    if route is None:
        route = _routes[module] = _Route(module)
    route.refs += 1

    def release() -> None:
        route.refs -= 1
        if route.refs == 0 and _routes.get(module) is route:
            _routes.pop(module).restore()

    return Handle(release)


def channels_last(fn: Callable[[Tensor], Tensor | None], heads: int | None) -> Callable[[Tensor], Tensor | None]:
    """`fn` sees the `(B, T, C)` transpose of a `(B, C, T)` tensor (split into `heads` if set);
    its edit comes back as a contiguous `(B, C, T)` tensor (a null edit has the same values)."""
    def call(x: Tensor) -> Tensor | None:
        y = x.transpose(1, 2)
        new = fn(y.unflatten(-1, (heads, -1)) if heads else y)
        if new is None:
            return None
        return (new.flatten(-2) if heads else new).transpose(1, 2).contiguous()

    return call
