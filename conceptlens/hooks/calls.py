"""Per-call dispatch for a layer module that a stack runs several times in one forward.

ALBERT runs one shared layer `num_hidden_layers` times; looped models run theirs once per
loop. Block i of such a stack is the i-th call of its module in this forward, so a hook on
the module (or on anything inside it) must act only during that call. While such hooks
exist, a counter on the module counts its calls (a forward pre-hook kept in front of every
other pre-hook of the module) and a pre-hook on the stack resets it at the start of each
stack forward (every `generate` step, every stopped-early forward included).

    handle = gated_hook(hooks, block, stack, call, fn, register)   # register(gated_fn) -> handle of the real hook
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from torch import Tensor, nn

from conceptlens.hooks.handles import Handle, HandleGroup, Removable

if TYPE_CHECKING:
    from conceptlens.hooks.manager import HookManager


class _Counter:
    def __init__(self, manager: HookManager, block: nn.Module, stack: nn.Module) -> None:
        self.manager, self.block, self.index, self.refs = manager, block, -1, 0
        self.handles = HandleGroup()
        try:
            self.pre = self.handles.add(manager.pre_hook(block, self._enter))
            self.handles.add(manager.pre_hook(stack, self._reset))
        except BaseException:
            self.handles.remove()
            raise

    def _enter(self, module, args) -> None:
        self.index += 1

    def _reset(self, module, args) -> None:
        self.index = -1

    def front(self) -> None:
        """Keep the counting pre-hook first, so pre-hooks at the block (resid_in) see this call."""
        self.manager.to_front(self.block, self.pre, pre=True)


def current_call(manager: HookManager, block: nn.Module) -> int | None:
    """Index (from 0) of the running or last call of `block` in this forward (None: not counted)."""
    counter = manager.counters.get(block)
    return None if counter is None else counter.index


def gated_hook(manager: HookManager, block: nn.Module, stack: nn.Module, call: int,
               fn: Callable[[Tensor], Tensor | None], register: Callable[[Callable], Removable]) -> Handle:
    """Register `register(gated)` where `gated` runs `fn` only during the `call`-th call of
    `block` in each forward of `stack` (and does nothing on its other calls)."""
    counter = manager.counters.get(block)
    if counter is None:
        counter = manager.counters[block] = _Counter(manager, block, stack)
    counter.refs += 1

    def release() -> None:
        counter.refs -= 1
        if counter.refs == 0 and manager.counters.get(block) is counter:
            manager.counters.pop(block).handles.remove()

    def gated(x: Tensor) -> Tensor | None:
        return fn(x) if counter.index == call else None

    group = HandleGroup()
    group.add(Handle(release))
    try:
        group.add(register(gated))
    except BaseException:
        group.remove()
        raise
    counter.front()
    return group
