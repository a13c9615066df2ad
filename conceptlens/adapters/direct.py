"""Blocks the stack calls through `forward` directly (SqueezeBERT; its layout, the attention's
output block beside the attention, is recognised by `structure.beside_layout`).

Used by `Adapter`: `direct_blocks` finds blocks whose hooks never ran in the probe although
modules inside them did; the probe then runs again with `routed(...)` (hooks/routed.py), and
their sites route the block's direct calls through `__call__` while they are hooked.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

from torch import nn

from conceptlens.adapters.probe_pass import Trace
from conceptlens.hooks.routed import route_through_call
from conceptlens.hooks.handles import HandleGroup

if TYPE_CHECKING:
    from conceptlens.hooks.manager import HookManager


def direct_blocks(blocks: dict[str, list[nn.Module]], trace: Trace) -> list[nn.Module]:
    """Blocks that never ran as modules although modules inside them did: their stack calls
    `block.forward(...)` directly (SqueezeBERT)."""
    found = []
    for stack_blocks in blocks.values():
        for block in dict.fromkeys(stack_blocks):
            if not trace.calls.get(block) and any(trace.calls.get(m) for m in block.modules() if m is not block):
                found.append(block)
    return found


@contextmanager
def routed(hooks: HookManager, modules: list[nn.Module]):
    """Direct `forward` calls of `modules` run their hooks inside the `with` (removed after)."""
    group = HandleGroup()
    try:
        for module in modules:
            group.add(route_through_call(hooks, module))
        yield
    finally:
        group.remove()


def reprobe_direct(hooks: HookManager, blocks: dict[str, list[nn.Module]], trace: Trace,
                   probe) -> tuple[list[nn.Module], Trace]:
    """(directly called blocks, the trace): where there are any, `probe()` runs again with their
    direct calls routed through their hooks."""
    direct = direct_blocks(blocks, trace)
    if direct:
        with routed(hooks, direct):
            trace = probe()
    return direct, trace
