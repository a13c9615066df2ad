"""Blocks whose stack calls `block.forward(...)` directly (the `Routed` view).

SqueezeBERT's encoder runs `layer.forward(hidden, mask, ...)`, which skips `nn.Module.__call__`,
so no hook on the layer ever runs. While a hook needs it, `route_through_call(module)` sets an
instance `forward` that sends a direct call through `module(...)` (hooks run, then the class's
forward); a call that already came through `__call__` goes straight to the real forward. The
last handle restores the instance exactly as it was (an instance `forward` set by someone else,
e.g. accelerate, is kept and called).

    handle = route_through_call(hooks, block)   # block.forward(...) now runs block's hooks
    handle.remove()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from conceptlens.hooks.handles import Handle, HandleGroup

if TYPE_CHECKING:
    from conceptlens.hooks.manager import HookManager


class _Route:
    def __init__(self, manager: HookManager, module: nn.Module) -> None:
        self.refs, self.depth = 0, 0
        saved = module.__dict__.get("forward")
        self.inner = saved if saved is not None else type(module).forward.__get__(module)
        self.call = module.__call__
        self.group = HandleGroup()
        try:  # depth > 0 while `__call__` runs this module: its forward call then goes straight through
            self.group.add(manager.pre_hook(module, self._enter, prepend=True))
            self.group.add(manager.forward_hook(module, self._leave, always_call=True))
            self.group.add(manager.patch(module, "forward", self.forward))
        except BaseException:
            self.group.remove()
            raise

    def _enter(self, module, args) -> None:
        self.depth += 1

    def _leave(self, module, args, output) -> None:
        self.depth = max(self.depth - 1, 0)

    def forward(self, *args, **kwargs):
        if self.depth:
            return self.inner(*args, **kwargs)
        return self.call(*args, **kwargs)


def route_through_call(manager: HookManager, module: nn.Module) -> Handle:
    """While the handle lives, a direct `module.forward(...)` call runs the module's hooks."""
    route = manager.routes.get(module)
    if route is None:
        route = manager.routes[module] = _Route(manager, module)
    route.refs += 1

    def release() -> None:
        route.refs -= 1
        if route.refs == 0 and manager.routes.get(module) is route:
            manager.routes.pop(module).group.remove()

    return Handle(release)
