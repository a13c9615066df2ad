"""Block lists that are not one module per layer, and where the last hidden state comes from.

Pure functions over the probe trace, used by `Adapter`:

- *Shared and looped layers* (ALBERT's one shared layer, Dory's and HRM's loops; a list of layer
  groups whose only child is a list of layers is flattened first): where a block module runs
  several times in one forward and its calls, in the order they finished, give one block per
  hidden state, block i is the i-th call (`Site.call`, gated by `hooks/calls.py`). The layout is
  read from the module's first call. Where the calls of the found list do not give one block per
  hidden state, every module of the block class in the stack is taken and the probe runs again
  (HRM keeps its L and H layers in two lists and cycles through both: 128 blocks from 32 modules
  in the tiny config). An HF module path naming a shared layer is refused (it is several blocks).
- *The final site*: the norm whose input is the last block's output (pre-LN models put its output
  in their last hidden state, so the last block's `resid_out` is the norm's input); a final norm
  that also runs inside the stack (Dory and NanoChat normalise the embeddings with it) is the call
  whose input is the last block's output. Where no norm reads it, the stack-level module (not a
  norm, list, embedding or rotary table) whose output is HF's last hidden state, at the end of a
  chain of at most two such modules, the first reading the last block's output exactly
  (DeepSeek-V4 and HY-V4: hyper-connection head then norm; Qwen4-exp: its stream mixer, so
  `final` has that module's width). `final` may read the last block's output as any argument.
- the row layout of a q/k/v projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from conceptlens.adapters.block_view import BlockView
from conceptlens.adapters.probe_pass import Trace, close
from conceptlens.adapters.structure import recognise


def only_list(module: nn.Module) -> list[nn.Module] | None:
    """The layers of a module whose only child is a ModuleList of recognisable layers."""
    children = list(module.children())
    if len(children) == 1 and isinstance(children[0], nn.ModuleList) and len(children[0]) and \
            all(recognise(m) is not None for m in children[0]):
        return list(children[0])
    return None


def same_class(blocks: list[nn.Module], stack: nn.Module, trace: Trace, hidden: tuple | None) -> list[nn.Module]:
    """Where blocks run several times but their calls do not match the hidden states: the other
    modules of the block class in the stack (HRM keeps its L and H layers in two lists)."""
    if all(trace.calls.get(b, 0) == 1 for b in blocks) or hidden is None or \
            sum(trace.calls.get(b, 0) for b in set(blocks)) + 1 == len(hidden):
        return []
    own = set(blocks)
    return [m for m in stack.modules() if type(m) is type(blocks[0]) and m not in own]


def unroll(blocks: list[nn.Module], trace: Trace, hidden: tuple | None) -> tuple[list[nn.Module], list[int]] | None:
    """Where a layer module runs several times in one forward, the blocks become its calls in
    the order they finished, when that gives one block per hidden state: (modules, call index of
    each); None when every block ran once or the calls do not match the hidden states."""
    if all(trace.calls.get(b, 0) == 1 for b in blocks):
        return None
    own = set(blocks)
    sequence = [m for m in trace.sequence if m in own]
    if not sequence or hidden is None or len(sequence) + 1 != len(hidden):
        return None  # check_stack names the block that did not run once
    calls: list[int] = []
    seen: dict[nn.Module, int] = {}  # block -> its calls so far
    for m in sequence:
        calls.append(seen.get(m, 0))
        seen[m] = calls[-1] + 1
    return sequence, calls


def final_by_input(last, candidates: list[nn.Module], trace: Trace) -> tuple[nn.Module | None, int | None]:
    """(norm whose input is the last block's output, which call of it; None if its only one)."""
    for module in candidates:
        n_calls = trace.calls.get(module, 0)
        for k in range(n_calls):  # a norm run inside the stack too (Dory): the call reading the last block
            x = trace.io(module, k)[0]
            if x is not None and last is not None and x.shape == last.shape and bool((x == last).all()):
                return module, (k if n_calls > 1 else None)
    return None, None


def _same(a, b) -> bool:
    return a is not None and b is not None and a.shape == b.shape and torch.equal(a, b)


def final_after(last, hidden: tuple | None, pool: list[nn.Module], trace: Trace) -> tuple[nn.Module | None, str]:
    """The module giving HF's last hidden state where one more module runs between the last
    block and it (DeepSeek-V4's hyper-connection head before the norm, Qwen4-exp's stream mixer):
    a chain of at most two stack-level modules, the first reading the last block's output."""
    if hidden is None or last is None:
        return None, ""
    target = hidden[-1][0] if isinstance(hidden[-1], (tuple, list)) else hidden[-1]
    for first in [m for m in pool if any(_same(x, last) for x in (trace.inputs.get(m), *trace.args.get(m, ())))]:
        if close(trace.outputs.get(first), target):
            return first, "it reads the last block's output"
        for second in pool:
            if second is not first and _same(trace.inputs.get(second), trace.outputs.get(first)) and \
                    close(trace.outputs.get(second), target):
                return second, f"it reads the output of {type(first).__name__}, which reads the last block's output"
    return None, ""


@dataclass(frozen=True)
class Final:
    """A stack's `final` site: its module (None: none found), which call of it (None: its only
    one) and, where no norm reads the last block's output, how the module was found."""

    module: nn.Module | None
    call: int | None = None
    note: str | None = None


def find_final(last, norms: list[nn.Module], after: list[nn.Module], hidden: tuple | None, trace: Trace) -> Final:
    """The norm whose input is the last block's output `last`, else the module of the norms and
    the modules `after` the blocks that gives HF's last hidden state (`final_after`)."""
    module, call = final_by_input(last, norms, trace)
    if module is not None:
        return Final(module, call)
    module, note = final_after(last, hidden, norms + after, trace)
    return Final(module, None, note if module is not None else None)


def projection_view(view: BlockView, block: nn.Module, proj: nn.Module, trace: Trace) -> BlockView | None:
    """The block's view, with time-major toggled where the projection runs on the transpose of
    the block's rows (Longformer's attention); None when its rows are neither."""
    x, y = trace.inputs.get(block), trace.outputs.get(proj)
    if x is None or y is None or y.ndim != 3 or x.shape[0] == x.shape[1]:
        return view
    if y.shape[:2] == x.shape[:2]:
        return view
    if y.shape[:2] == (x.shape[1], x.shape[0]):
        return view.transposed()
    return None
