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

An edit's change, which the narrower output cannot hold, is added to the receiver's input (and
also to the block output where the receiver does not pass the streams on, so the block adds them
itself: HY-V4), or to the block output for the last sublayer (`hooks/hyper.py`). Such a block
counts as additive even if no norm reads its input. A residual with its streams in a dimension of
their own, `(n, d)` (HY-V4, DeepSeek-V4), gives `(B, T, n, d)` residual sites (DeepSeek-V4's
sublayer sites keep their module's width); a further child adding its full-width output to the
streams is `branch_out` (Qwen4-exp's `ple`).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from conceptlens.adapters.probe_pass import Trace, close
from conceptlens.adapters.structure import BlockLayout, is_norm
from conceptlens.sites.hooked_views import Expansion, spread

_KINDS = ("attn_out", "cross_attn_out", "mixer_out", "mlp_out", "branch_out")


def site_shape(resid: tuple, module: nn.Module, trace: Trace, spread: bool) -> tuple:
    """A sublayer site's symbolic shape: the residual's, but a module's own (B, T, d) where the
    residual keeps its streams in a dimension of their own and the site is not spread over them."""
    out = trace.outputs.get(module)
    if spread or out is None or len(resid) < 4 or out.ndim != 3:
        return resid
    return ("B", "T", int(out.shape[-1]))


def _get(block: nn.Module, path: str | None) -> nn.Module | None:
    try:
        return block.get_submodule(path) if path else None
    except AttributeError:
        return None


def _same(a: Tensor | None, b: Tensor) -> bool:
    return a is not None and a.shape == b.shape and torch.equal(a, b)


def _inside(module: nn.Module, other: nn.Module) -> bool:
    return any(m is other for m in module.modules())


def _streams(x: Tensor, out: Tensor) -> tuple[int, bool] | None:
    """(n, flat) when a sublayer output (B, T, d) is narrower than a residual of n streams:
    (B, T, n * d) flat, or (B, T, n, d); None otherwise."""
    d = out.shape[-1]
    if x.ndim == out.ndim + 1 and x.shape[-1] == d and x.shape[:-2] == out.shape[:-1] and x.shape[-2] > 1:
        return int(x.shape[-2]), False
    if x.ndim == out.ndim and x.shape[:-1] == out.shape[:-1] and x.shape[-1] % d == 0 and x.shape[-1] > d:
        return int(x.shape[-1] // d), True
    return None


def _gate(block: nn.Module, sub: nn.Module, out: Tensor, n: int, trace: Trace,
          order: list[nn.Module]) -> tuple[nn.Module, int, Tensor] | None:
    """(gate module, element of its output, weights): the last module before the sublayer to
    return a (B, T, n) tensor."""
    shape = (*out.shape[:-1], n)
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
              order: list[nn.Module]) -> tuple[nn.Module, bool] | None:
    """(the block's child that reads the streams after `sub`, whether it passes them on); where
    it does not, the block adds them to its output itself (checked by the caller's sum)."""
    for module in block.children():
        if module not in trace.outputs or order.index(module) < order.index(sub):
            continue
        x = trace.inputs.get(module)
        if x is not None and close(x, streams):
            return module, any(p is not None and _same(p, x) for p in trace.parts.get(module, ()))
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
    paths = {k: path for k in _KINDS if (path := getattr(lay, k, None))}
    subs = {k: m for k, path in paths.items() if (m := _get(block, path)) is not None and m in trace.outputs}
    if x is None or y is None or x.shape != y.shape or len(subs) != len(paths):
        return None
    order = list(trace.outputs)
    found: dict[str, Expansion] = {}
    streams, n_streams = x, 0
    kinds = sorted(subs, key=lambda k: order.index(subs[k]))
    for j, kind in enumerate(kinds):
        sub, out = subs[kind], trace.outputs[subs[kind]]
        if out.shape == x.shape:
            streams = streams + out
            continue
        layout = _streams(x, out)
        if layout is None or (gate := _gate(block, sub, out, layout[0], trace, order)) is None:
            return None
        n_streams = n_streams or layout[0]
        streams = streams + spread(out, gate[2], layout[1]).to(streams.dtype)
        last = j == len(kinds) - 1
        receiver = (block, True) if last else _receiver(block, sub, streams, trace, order)
        if receiver is None:
            return None
        point: Literal["input", "output", "both"] = "output" if last else "input" if receiver[1] else "both"
        found[kind] = Expansion(gate[0], gate[1], receiver[0], point, layout[1], block)
    if not found or not close(streams, y, 1e-4):
        return None
    _describe(block, lay, n_streams, found)
    return found


def _describe(block: nn.Module, lay: BlockLayout, n_streams: int, found: dict[str, Expansion]) -> None:
    """The notes of the sublayers spread over the residual's `n_streams` streams."""
    names = {m: n for n, m in block.named_modules()}
    for kind, exp in found.items():
        form = "(out[..., None, :] * w[..., :, None])" + (".flatten(-2)" if exp.flat else "")
        then = {"output": "the block's output", "input": f"the input of {names[exp.receiver]}",
                "both": f"the input of {names[exp.receiver]} and the block's output"}[exp.point]
        lay.notes[kind] = (f"spread over the residual's {n_streams} streams: the output times the per-stream weights "
                           f"{names[exp.gate]} returns, as {form} (hyper-connections): what it adds to the "
                           f"residual; an edit's change is added to {then}")
