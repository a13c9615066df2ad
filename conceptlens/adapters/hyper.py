"""Blocks whose residual holds several streams and whose sublayers work on one (hyper-connections).

In Qwen4-exp every block keeps n residual streams of width d side by side, a (B, T, n * d)
tensor. A gate module (`attn_hyper_connection`, `mlp_hyper_connection`) reads the streams and
returns the sublayer's d-wide input together with n per-stream weights w; the sublayer's output
a is written back to every stream, scaled by its weight:

    streams = streams + (a[..., None, :] * w[..., :, None]).flatten(-2)

so the block is additive at the residual's width, with that flattened outer product as the
sublayer's contribution. It is no module's output, so the adapter finds it on the probe: the
gate (the last module before the sublayer to return a (B, T, n) tensor), and the module that
reads the streams after the sublayer (the next gate, which passes them on), or the block output
for the last sublayer; the chain `resid_in + contributions` must give each of those exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from conceptlens.adapters.probe import Trace, close
from conceptlens.adapters.site import Expansion
from conceptlens.adapters.structure import BlockLayout, is_norm
from conceptlens.adapters.verify import submodule

_KINDS = ("attn_out", "cross_attn_out", "mixer_out", "mlp_out", "branch_out")


def spread(out: Tensor, weights: Tensor) -> Tensor:
    """A sublayer output (..., d) written to n streams with weights (..., n): (..., n * d)."""
    return (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)


def _same(a: Tensor | None, b: Tensor) -> bool:
    return a is not None and a.shape == b.shape and torch.equal(a, b)


def _inside(module: nn.Module, other: nn.Module) -> bool:
    return any(m is other for m in module.modules())


def _gate(block: nn.Module, sub: nn.Module, out: Tensor, width: int, trace: Trace,
          order: list[nn.Module]) -> tuple[nn.Module, int, Tensor] | None:
    """(gate module, element of its output, weights) for a sublayer output narrower than the residual."""
    d = out.shape[-1]
    if width % d or width == d:
        return None
    shape = (*out.shape[:-1], width // d)
    before = order.index(sub)
    found = None
    for module in block.modules():
        if module not in trace.parts or _inside(sub, module) or order.index(module) > before:
            continue
        for i, part in enumerate(trace.parts[module]):
            if part is not None and tuple(part.shape) == shape and \
                    (found is None or order.index(module) > order.index(found[0])):
                found = (module, i, part)
    return found


def _receiver(block: nn.Module, sub: nn.Module, streams: Tensor, trace: Trace,
              order: list[nn.Module]) -> nn.Module | None:
    """The block's child that reads the streams after `sub` and passes them on unchanged."""
    for module in block.children():
        if module not in trace.outputs or order.index(module) < order.index(sub):
            continue
        x = trace.inputs.get(module)
        passes_on = any(p is not None and p.shape == streams.shape and torch.equal(p, x)
                        for p in trace.parts.get(module, ()))
        if x is not None and close(x, streams) and passes_on:
            return module
    return None


def stream_writes(block: nn.Module, lay: BlockLayout, trace: Trace) -> dict[str, Expansion] | None:
    """Kind -> how that sublayer's output is spread over the residual streams, for a block whose
    outputs add up that way (every other sublayer adds its own output); None if it does not.
    Where they do not, a further child that adds its full-width output to the streams is tried
    as `branch_out` (Qwen4-exp's per-layer n-gram embedding, `ple`, at some layers)."""
    found = _writes(block, lay, trace)
    if found is not None or lay.branch_out is not None or trace.inputs.get(block) is None:
        return found
    x = trace.inputs[block]
    taken = {getattr(lay, k) for k in _KINDS}
    for name, child in block.named_children():
        out = trace.outputs.get(child)
        if name in taken or out is None or out.shape != x.shape or _same(trace.inputs.get(child), x) and \
                is_norm(name, child):
            continue
        lay.branch_out = name
        found = _writes(block, lay, trace)
        if found is not None:
            lay.notes["branch_out"] = "a further branch whose output the block adds to the residual streams"
            return found
    lay.branch_out = None
    return None


def _writes(block: nn.Module, lay: BlockLayout, trace: Trace) -> dict[str, Expansion] | None:
    x, y = trace.inputs.get(block), trace.outputs.get(block)
    subs = {k: submodule(block, getattr(lay, k)) for k in _KINDS if getattr(lay, k, None)}
    if x is None or y is None or any(m not in trace.outputs for m in subs.values()):
        return None
    order = list(trace.outputs)
    found: dict[str, Expansion] = {}
    gates: dict[str, nn.Module] = {}
    streams = x
    kinds = sorted(subs, key=lambda k: order.index(subs[k]))
    for j, kind in enumerate(kinds):
        sub, out = subs[kind], trace.outputs[subs[kind]]
        if out.shape == x.shape:
            streams = streams + out
            continue
        gate = _gate(block, sub, out, x.shape[-1], trace, order)
        if gate is None or out.shape[:-1] != x.shape[:-1]:
            return None
        streams = streams + spread(out, gate[2]).to(streams.dtype)
        last = j == len(kinds) - 1
        receiver = block if last else _receiver(block, sub, streams, trace, order)
        if receiver is None:
            return None
        found[kind] = Expansion(gate[0], gate[1], receiver, "output" if last else "input")
        gates[kind] = gate[0]
    if not found or not close(streams, y, 1e-4):
        return None
    names = {m: n for n, m in block.named_modules()}
    for kind, exp in found.items():
        n = x.shape[-1] // trace.outputs[subs[kind]].shape[-1]
        then = "the block's output" if exp.receiver is block else f"the input of {names[exp.receiver]}"
        lay.notes[kind] = (f"spread over the residual's {n} streams: the output times the per-stream weights "
                           f"{names[gates[kind]]} returns, as (out[..., None, :] * w[..., :, None]).flatten(-2) "
                           f"(hyper-connections): what it adds to the residual; an edit's change is added to {then}")
    return found
