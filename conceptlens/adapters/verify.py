"""Finish block layouts from the probe trace, then check them against HF's hidden states.

The checks: every block runs once (or once per call, for shared layers); `embed` is HF's
`hidden_states[0]` (position embeddings, Gemma's scaling, BART's embedding norm included); each
block's `resid_out` is `hidden_states[i + 1]`, except that pre-LN models put the final norm's
output in their last hidden state (the `final` site); Mamba-style models list only block outputs
(`hidden_states[i]` is block i's output, the last one normed: `hidden_offset` 0). A mismatch
raises `LayoutError`, a `ValueError` naming the block. For additive blocks the sublayer sites
must sum to `resid_out` at 1e-4 (`probe.sums_to`), else `repair.py` and the idiom files try
their readings.

The stack's view of its blocks (time-major, added positions, ...) is `block_view.py`'s.
"""

from __future__ import annotations

import torch
from torch import nn

from conceptlens.adapters.block_view import BlockView, as_hidden
from conceptlens.adapters.depth import depth_mixers
from conceptlens.adapters.stream_writes import stream_writes
from conceptlens.adapters.inner import inner_call
from conceptlens.adapters.probe_pass import Call, Trace, close, sums_to
from conceptlens.adapters.structure import BlockLayout, is_norm


class LayoutError(ValueError):
    """A structurally found layout does not reproduce the model's own hidden states."""


def _path_in(block: nn.Module, target: nn.Module) -> str | None:
    for name, module in block.named_modules():
        if module is target:
            return name
    return None


def _top(path: str, block: nn.Module) -> str:
    """The direct child of the block on `path` (a T5 `layer.i` part counts as a level)."""
    parts = path.split(".")
    if parts[0] == "layer" and isinstance(getattr(block, "layer", None), nn.ModuleList):
        return ".".join(parts[:2])
    return parts[0]


def refine(block: nn.Module, lay: BlockLayout, trace: Trace) -> None:
    """Use what the probe saw: attention callers, post-sublayer norms, pre-norm, flat MLP."""
    depth = depth_mixers(block, lay, trace)  # attention over earlier layers' states (Inkling 2)
    calls = [c for c in trace.attention if _path_in(block, c.module) is not None and c.module not in depth]
    own = {c.module: c for c in calls}
    self_calls = [c for c in own.values() if c.q_len == c.k_len]
    cross_calls = [c for c in own.values() if c.q_len != c.k_len]
    if self_calls and (path := _path_in(block, self_calls[0].module)) is not None:
        if lay.attn is None or lay.attn != path:
            lay.attn = path
            lay.attn_out = lay.attn_out or _top(path, block)
    if cross_calls and (path := _path_in(block, cross_calls[0].module)) is not None:
        lay.cross_attn = path
        lay.cross_attn_out = lay.cross_attn_out or _top(path, block)
    if lay.mixer_out is not None and lay.mixer_out == lay.attn_out:
        lay.mixer_out = None  # a hybrid's temporal block that is attention in this layer: counted once
    children = dict(block.named_children())
    for key in ("attn_out", "cross_attn_out", "mixer_out", "mlp_out"):
        path = getattr(lay, key)
        module = children.get(path) if path else None
        out = trace.outputs.get(module) if module is not None else None
        if out is None:
            continue
        for name, child in children.items():
            if is_norm(name, child) and child in trace.inputs and trace.inputs[child].shape == out.shape \
                    and torch.equal(trace.inputs[child], out):
                lay.replaced[key] = path
                setattr(lay, key, name)
                lay.notes[key] = f"after the post-sublayer norm {name} ({type(child).__name__}), as added to the residual"
                break
    x = trace.inputs.get(block)
    norms = [m for n, m in block.named_modules() if n and is_norm(n.rpartition(".")[2], m)]
    pre = any(m in trace.inputs and x is not None and trace.inputs[m].shape == x.shape and
              torch.equal(trace.inputs[m], x) and _before_sublayers(m, block, lay, trace) for m in norms)
    lay.additive = pre or not norms or bool(depth)  # sublayers reading a depth mix: the sum is checked
    if not lay.additive and stream_writes(block, lay, trace) is not None:
        lay.additive = True  # residual streams (HY-V4): its norms read a gate's output, the block still adds
    mlp = submodule(block, lay.mlp_out)
    if mlp is not None and x is not None and mlp in trace.outputs and trace.outputs[mlp].ndim == x.ndim - 1:
        lay.flat_mlp = True
    if not lay.additive:
        _norm_inside(block, lay, trace)
        streams = x is not None and x.ndim == 4  # (B, T, n, d): streams the block mixes (DeepSeek-V4)
        lay.style += ", residual streams mixed inside the block" if streams else \
            ", post-LN (the norm follows the residual add)"
        note = "the sublayer's output; the block mixes its residual streams, so not what it adds to them" \
            if streams else "post-LN: the sublayer output before the residual add and norm"
        for key in ("attn_out", "mlp_out", "cross_attn_out", "mixer_out"):
            lay.notes.setdefault(key, note)


def _before_sublayers(norm: nn.Module, block: nn.Module, lay: BlockLayout, trace: Trace) -> bool:
    """A pre-norm runs before the sublayers it feeds. A norm that reads the block input only
    because the sublayer before it added exactly zero (MRA's attention without its CUDA kernel,
    in a post-LN block) finishes after that sublayer's output module."""
    order = {m: i for i, m in enumerate(trace.outputs)}  # the order modules finished in
    subs = [submodule(block, getattr(lay, k)) for k in ("attn_out", "cross_attn_out", "mixer_out", "mlp_out")]
    done = [order[m] for m in subs if m is not None and m in order and _path_in(m, norm) is None]
    return norm in order and all(order[norm] < i for i in done)


def _norm_inside(block: nn.Module, lay: BlockLayout, trace: Trace) -> None:
    """A post-LN sublayer whose output is a norm's inside it (XLNet's, ALBERT's attention) has
    added the residual itself: read its output projection where sublayer input + projection
    output is exactly that norm's input, else leave the site out (`lay.dropped`)."""
    for key in ("attn_out", "cross_attn_out", "mixer_out", "mlp_out"):
        path = getattr(lay, key)
        module = submodule(block, path)
        if module is None:
            continue
        out, inp = trace.outputs.get(module), trace.inputs.get(module)
        norm = next((m for n, m in module.named_modules() if n and is_norm(n.rpartition(".")[2], m) and
                     _same(trace.outputs.get(m), out)), None)
        if norm is None or inp is None:
            continue
        inner = _last_projection(block, path, trace)
        inner_module = submodule(block, inner) if inner else None
        proj = trace.outputs.get(inner_module) if inner_module is not None else None
        if proj is not None and proj.shape == inp.shape and close(inp + proj, trace.inputs.get(norm)):
            setattr(lay, key, inner)
            lay.notes[key] = f"{path} adds and norms the residual inside itself: its output projection, before that"
        elif (found := inner_call(module, norm, trace)) is not None:
            setattr(lay, key, f"{path}.{found[0]}")
            lay.inner_calls[key] = (found[1], path)
            lay.notes[key] = f"{path} adds and norms the residual inside itself: what it adds is call {found[1]} " \
                             f"(from 0) of {found[0]} in each forward of {path}"
        else:
            lay.dropped[key] = f"{path} ({type(module).__name__}) adds and norms the residual inside itself, and " \
                               "no module gives what it adds"


def submodule(block: nn.Module, path: str | None) -> nn.Module | None:
    """`block.get_submodule(path)`, or None when the path is empty or names no module."""
    if not path:
        return None
    try:
        return block.get_submodule(path)
    except AttributeError:
        return None


def call_of(trace: Trace, module: nn.Module | None) -> Call | None:
    return next((c for c in trace.attention if c.module is module), None)


def check_stack(prefix: str, blocks: list[nn.Module], final: nn.Module | None, trace: Trace, what: str,
                calls: list[int] | None = None, final_call: int | None = None,
                view: BlockView = BlockView()) -> int:
    """resid_out of every block (and embed, final) against HF's hidden states; raise LayoutError.

    Returns the offset of block i's output in the hidden states: 1 when hidden_states[0] is
    the embedding (most models), 0 when the model lists only block outputs (Mamba).
    """
    p = f"{prefix}." if prefix else ""
    virtual, calls = calls is not None, calls or [0] * len(blocks)
    for i, block in enumerate(blocks):
        if not virtual and trace.calls.get(block, 0) != 1:
            raise LayoutError(f"{what}: {p}blocks.{i} ({type(block).__name__}) ran {trace.calls.get(block, 0)} times "
                              "in one forward (shared or skipped blocks), so its sites are not one layer's")
    hidden = trace.hidden.get(prefix)
    if hidden is None:
        return 1  # the model returns no hidden states for this stack: nothing to check against
    n = len(blocks)
    if len(hidden) != n + 1:
        raise LayoutError(f"{what}: found {n} {p}blocks but the model returns {len(hidden)} hidden states")
    first = trace.inputs.get(blocks[0])
    length = hidden[0].shape[1] if hidden[0] is not None and hidden[0].ndim >= 2 else 0
    offset = 1 if close(as_hidden(first, view, length), hidden[0]) else 0
    if not offset and not close(trace.outputs.get(blocks[0]), hidden[0]):
        raise LayoutError(f"{what}: neither the input nor the output of {p}blocks.0 is the model's hidden_states[0]")
    for i, block in enumerate(blocks):
        out = trace.io(block, calls[i])[1]
        out = as_hidden(out, view, length)
        if i + offset == n and not close(out, hidden[n]):
            out = as_hidden(trace.io(final, final_call)[1], view, length) if final is not None else None
        if not close(out, hidden[i + offset]):
            raise LayoutError(f"{what}: the output of {p}blocks.{i} ({type(block).__name__}) is not the model's "
                              f"hidden_states[{i + offset}]")
    if not offset and not close(trace.io(final, final_call)[1] if final is not None else None, hidden[n]):
        raise LayoutError(f"{what}: hidden_states[{n}] is not the output of a final norm")
    return offset


def _contributions(block: nn.Module, lay: BlockLayout, trace: Trace) -> dict[str, torch.Tensor] | str:
    """The probe's output of each sublayer site of an additive block (float, residual-shaped),
    or why one cannot be used."""
    x = trace.inputs.get(block)
    if x is None:
        return "the block did not run"
    outs: dict[str, torch.Tensor] = {}
    for key in ("attn_out", "cross_attn_out", "mixer_out", "mlp_out", "branch_out"):
        module = submodule(block, getattr(lay, key))
        if module is None:
            continue
        out = trace.outputs.get(module)
        for part in lay.parts.get(key, ()):  # several sublayers of one kind: their outputs summed
            sub = submodule(block, part)
            more = trace.outputs.get(sub) if sub is not None else None
            out = out + more if out is not None and more is not None and more.shape == out.shape else None
        if out is None and key == "cross_attn_out":
            continue  # a decoder run without an encoder (e.g. WhisperForCausalLM) skips cross-attention
        if out is None:
            return f"{key} ({getattr(lay, key)}) did not run"
        if lay.flat_mlp and key == "mlp_out":
            out = out.view(*x.shape[:-1], -1)
        if out.shape != x.shape:
            return f"{key} ({getattr(lay, key)}) has shape {tuple(out.shape)}, not the residual's {tuple(x.shape)}"
        outs[key] = out.float()
    return outs


def sum_problem(block: nn.Module, lay: BlockLayout, trace: Trace) -> str | None:
    """Why resid_in + sublayer outputs != resid_out for an additive block (None if it holds)."""
    x, y = trace.inputs.get(block), trace.outputs.get(block)
    if x is None or y is None:
        return None
    outs = _contributions(block, lay, trace)
    if isinstance(outs, str):
        return outs
    if not sums_to(x, list(outs.values()), y):
        return "resid_in + attn_out + mlp_out differs from resid_out"
    return None


def _last_projection(block: nn.Module, path: str, trace: Trace) -> str | None:
    """Path (from the block) of the last linear layer to finish inside the sublayer at `path`:
    its output projection, the contribution when the sublayer adds the residual itself."""
    sub = submodule(block, path)
    if sub is None:
        return None
    names = {m: n for n, m in sub.named_modules() if n and (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")}
    done = [m for m in trace.outputs if m in names]  # the trace keeps the order modules finished in
    return f"{path}.{names[done[-1]]}" if done else None


def _same(a, b) -> bool:
    return a is not None and b is not None and a.shape == b.shape and torch.equal(a, b)
