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


def _contributions(block: nn.Module, lay: BlockLayout, trace: Trace) -> dict[str, torch.Tensor] | str:
    """The probe's output of each sublayer site of an additive block (float, residual-shaped),
    or why one cannot be used."""
    x = trace.inputs.get(block)
    outs: dict[str, torch.Tensor] = {}
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
    if not close(x.float() + sum(outs.values()), y.float(), 1e-4):
        return "resid_in + attn_out + mlp_out differs from resid_out"
    return None


def residual_scales(block: nn.Module, lay: BlockLayout, trace: Trace) -> dict[str, float] | None:
    """For a block that adds each sublayer's output times a constant (Granite's
    `residual_multiplier`, MiniCPM's depth scaling): the constants, fitted on the probe by least
    squares and kept only if `resid_in + sum(c_k * out_k)` then equals resid_out (1e-4, the
    tolerance of the plain sum). None when no such constants reproduce the block."""
    x, y = trace.inputs.get(block), trace.outputs.get(block)
    outs = _contributions(block, lay, trace) if x is not None and y is not None else "no probe"
    if isinstance(outs, str) or not outs:
        return None
    a = torch.stack([o.reshape(-1) for o in outs.values()], dim=1).double()
    b = (y.float() - x.float()).reshape(-1).double()
    if a.shape[0] <= 4 * a.shape[1] or torch.linalg.matrix_rank(a) < a.shape[1]:
        return None
    c = torch.linalg.lstsq(a, b[:, None]).solution[:, 0]
    if not bool(torch.isfinite(c).all()) or bool((c.abs() < 1e-6).any()):
        return None
    scales = {key: float(v) for key, v in zip(outs, c)}
    total = x.float() + sum(scales[k] * o for k, o in outs.items())
    return scales if close(total, y.float(), 1e-4) else None


def _last_projection(block: nn.Module, path: str, trace: Trace) -> str | None:
    """Path (from the block) of the last linear layer to finish inside the sublayer at `path`:
    its output projection, the contribution when the sublayer adds the residual itself."""
    sub = submodule(block, path)
    if sub is None:
        return None
    names = {m: n for n, m in sub.named_modules() if n and (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")}
    done = [m for m in trace.outputs if m in names]  # the trace keeps the order modules finished in
    return f"{path}.{names[done[-1]]}" if done else None


def repair(block: nn.Module, lay: BlockLayout, trace: Trace) -> tuple[str | None, dict[str, float] | None]:
    """For an additive block whose sum fails: (None, scales) if reading some sublayers at their
    output projection (a sublayer that adds the residual inside itself) and/or constant
    residual multipliers make it exact (`lay` is changed to match), else (the problem, None)."""
    problem = sum_problem(block, lay, trace)
    if problem is None:
        return None, None
    kinds = [k for k in ("attn_out", "cross_attn_out", "mixer_out", "mlp_out") if getattr(lay, k)]
    inner = {k: _last_projection(block, getattr(lay, k), trace) for k in kinds}
    options = [k for k in kinds if inner[k] is not None]
    original = {k: getattr(lay, k) for k in kinds}
    for mask in range(1 << len(options)):
        for i, k in enumerate(options):
            setattr(lay, k, inner[k] if mask >> i & 1 else original[k])
        if mask and sum_problem(block, lay, trace) is None:
            for k in options:
                if getattr(lay, k) != original[k]:
                    lay.notes[k] = f"output of {getattr(lay, k)}: {original[k]} adds the residual inside itself"
            return None, None
        scales = residual_scales(block, lay, trace)
        if scales:
            for k in options:
                if getattr(lay, k) != original[k]:
                    lay.notes[k] = f"output of {getattr(lay, k)}: {original[k]} adds the residual inside itself"
            return None, scales
    for k in kinds:
        setattr(lay, k, original[k])
    return problem, None
