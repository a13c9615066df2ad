"""Blocks the stack calls through `forward` directly, and BERT-style blocks whose attention's
output block sits beside the attention (SqueezeBERT: attention / post_attention / intermediate /
output, each projection a 1x1 `Conv1d` on channels-first `(B, C, T)` tensors).

Used by `Adapter`: `direct_blocks` finds blocks whose hooks never ran in the probe although
modules inside them did; the probe then runs again with `routed(...)` (hooks/direct.py), and
their sites route the block's direct calls through `__call__` while they are hooked.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

from torch import nn

from conceptlens.adapters.probe import Trace
from conceptlens.adapters.structure import BlockLayout
from conceptlens.hooks.direct import route_through_call
from conceptlens.hooks.handles import HandleGroup

if TYPE_CHECKING:
    from conceptlens.hooks.manager import HookManager

_BESIDE = ("post_attention", "attention_output", "attn_output")
_PROJ = ("dense", "conv1d")


def _projection(module: nn.Module | None) -> str | None:
    return next((n for n in _PROJ if hasattr(getattr(module, n, None), "weight")), None)


def beside_layout(block: nn.Module) -> BlockLayout | None:
    """attention + its output block as a sibling (`post_attention`) + intermediate + output."""
    children = dict(block.named_children())
    beside = next((n for n in _BESIDE if n in children), None)
    if "attention" not in children or beside is None or "intermediate" not in children:
        return None
    a, o = _projection(children[beside]), _projection(children.get("output"))
    if a is None or o is None:
        return None
    return BlockLayout(f"BERT-style with the attention's output beside it (attention / {beside} / intermediate / "
                       "output)", attn="attention", attn_out=f"{beside}.{a}", mlp_out=f"output.{o}",
                       mlp_post=f"output.{o}", attn_z=f"{beside}.{a}")


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
