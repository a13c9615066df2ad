"""Finish block layouts from the probe trace, then check them against HF's hidden states."""

from __future__ import annotations

import torch
from torch import nn

from conceptlens.adapters.probe import Call, Trace, close
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
    calls = [c for c in trace.attention if _path_in(block, c.module) is not None]
    own = {c.module: c for c in calls}
    self_calls = [c for c in own.values() if c.q_len == c.k_len]
    cross_calls = [c for c in own.values() if c.q_len != c.k_len]
    if self_calls:
        path = _path_in(block, self_calls[0].module)
        if lay.attn is None or lay.attn != path:
            lay.attn = path
            lay.attn_out = lay.attn_out or _top(path, block)
    if cross_calls:
        path = _path_in(block, cross_calls[0].module)
        lay.cross_attn = path
        lay.cross_attn_out = lay.cross_attn_out or _top(path, block)
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
                setattr(lay, key, name)
                lay.notes[key] = f"after the post-sublayer norm {name} ({type(child).__name__}), as added to the residual"
                break
    x = trace.inputs.get(block)
    norms = [m for n, m in block.named_modules() if n and is_norm(n.rpartition(".")[2], m)]
    pre = any(m in trace.inputs and x is not None and trace.inputs[m].shape == x.shape and
              torch.equal(trace.inputs[m], x) for m in norms)
    lay.additive = pre or not norms
    mlp = submodule(block, lay.mlp_out)
    if mlp is not None and x is not None and mlp in trace.outputs and trace.outputs[mlp].ndim == x.ndim - 1:
        lay.flat_mlp = True
    if not lay.additive:
        lay.style += ", post-LN (the norm follows the residual add)"
        for key in ("attn_out", "mlp_out", "cross_attn_out"):
            lay.notes.setdefault(key, "post-LN: the sublayer output before the residual add and norm")


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


def check_stack(prefix: str, blocks: list[nn.Module], final: nn.Module | None, trace: Trace, what: str) -> int:
    """resid_out of every block (and embed, final) against HF's hidden states; raise LayoutError.

    Returns the offset of block i's output in the hidden states: 1 when hidden_states[0] is
    the embedding (most models), 0 when the model lists only block outputs (Mamba).
    """
    p = f"{prefix}." if prefix else ""
    for i, block in enumerate(blocks):
        if trace.calls.get(block, 0) != 1:
            raise LayoutError(f"{what}: {p}blocks.{i} ({type(block).__name__}) ran {trace.calls.get(block, 0)} times "
                              "in one forward (shared or skipped blocks), so its sites are not one layer's")
    hidden = trace.hidden.get(prefix)
    if hidden is None:
        return 1  # the model returns no hidden states for this stack: nothing to check against
    n = len(blocks)
    if len(hidden) != n + 1:
        raise LayoutError(f"{what}: found {n} {p}blocks but the model returns {len(hidden)} hidden states")
    offset = 1 if close(trace.inputs.get(blocks[0]), hidden[0]) else 0
    if not offset and not close(trace.outputs.get(blocks[0]), hidden[0]):
        raise LayoutError(f"{what}: neither the input nor the output of {p}blocks.0 is the model's hidden_states[0]")
    for i, block in enumerate(blocks):
        out = trace.outputs.get(block)
        if i + offset == n and not close(out, hidden[n]):
            out = trace.outputs.get(final) if final is not None else None
        if not close(out, hidden[i + offset]):
            raise LayoutError(f"{what}: the output of {p}blocks.{i} ({type(block).__name__}) is not the model's "
                              f"hidden_states[{i + offset}]")
    if not offset and not close(trace.outputs.get(final) if final is not None else None, hidden[n]):
        raise LayoutError(f"{what}: hidden_states[{n}] is not the output of a final norm")
    return offset


def sum_problem(block: nn.Module, lay: BlockLayout, trace: Trace) -> str | None:
    """Why resid_in + sublayer outputs != resid_out for an additive block (None if it holds)."""
    x, y = trace.inputs.get(block), trace.outputs.get(block)
    if x is None or y is None:
        return None
    total = x.float()
    for key in ("attn_out", "cross_attn_out", "mixer_out", "mlp_out"):
        module = submodule(block, getattr(lay, key))
        if module is None:
            continue
        out = trace.outputs.get(module)
        if out is None and key == "cross_attn_out":
            continue  # a decoder run without an encoder (e.g. WhisperForCausalLM) skips cross-attention
        if out is None:
            return f"{key} ({getattr(lay, key)}) did not run"
        if lay.flat_mlp and key == "mlp_out":
            out = out.view(*x.shape[:-1], -1)
        if out.shape != x.shape:
            return f"{key} ({getattr(lay, key)}) has shape {tuple(out.shape)}, not the residual's {tuple(x.shape)}"
        total = total + out.float()
    if not close(total, y.float(), 1e-4):
        return "resid_in + attn_out + mlp_out differs from resid_out"
    return None
