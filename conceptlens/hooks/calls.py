"""Per-call dispatch for a layer module that a stack runs several times in one forward.

ALBERT runs one shared layer `num_hidden_layers` times; looped models run theirs once per
loop. Block i of such a stack is the i-th call of its module in this forward, so a hook on
the module (or on anything inside it) must act only during that call. While such hooks
exist, a counter on the module counts its calls (a forward pre-hook kept in front of every
other pre-hook of the module) and a pre-hook on the stack resets it at the start of each
stack forward (every `generate` step, every stopped-early forward included).

    handle = gated_hook(site, register)   # register(gated_fn) -> handle of the real hook
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor, nn

from conceptlens.hooks.handles import Handle, HandleGroup


class _Counter:
    def __init__(self, block: nn.Module, stack: nn.Module) -> None:
        self.block, self.index, self.refs = block, -1, 0
        self.pre = block.register_forward_pre_hook(self._enter)
        self.reset = stack.register_forward_pre_hook(self._reset)

    def _enter(self, module, args) -> None:
        self.index += 1

    def _reset(self, module, args) -> None:
        self.index = -1

    def front(self) -> None:
        """Keep the counting pre-hook first, so pre-hooks at the block (resid_in) see this call."""
        self.block._forward_pre_hooks.move_to_end(self.pre.id, last=False)

    def remove(self) -> None:
        self.pre.remove()
        self.reset.remove()


_counters: dict[nn.Module, _Counter] = {}


def current_call(block: nn.Module) -> int | None:
    """Index (from 0) of the running or last call of `block` in this forward (None: not counted)."""
    counter = _counters.get(block)
    return None if counter is None else counter.index


def gated_hook(block: nn.Module, stack: nn.Module, call: int,
               fn: Callable[[Tensor], Tensor | None], register: Callable[[Callable], Handle]) -> Handle:
    """Register `register(gated)` where `gated` runs `fn` only during the `call`-th call of
    `block` in each forward of `stack` (and does nothing on its other calls)."""
    counter = _counters.get(block)
    if counter is None:
        counter = _counters[block] = _Counter(block, stack)
    counter.refs += 1

    def release() -> None:
        counter.refs -= 1
        if counter.refs == 0 and _counters.get(block) is counter:
            _counters.pop(block).remove()

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
