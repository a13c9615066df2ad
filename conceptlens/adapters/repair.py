"""Exact readings of an additive block whose plain sum fails.

`repair` tries, on the probe, every exact reading of the block's sublayers before any fitted one,
each kept only if `resid_in + sum(sites) == resid_out` then holds at 1e-4:

- a sublayer that adds the residual inside itself (MPT's FFN, Bloom) is read at its output
  projection, the last linear layer to finish inside it;
- a module applied to a sublayer's output (Inkling's short convolutions) replaces it;
- a module run beside it on the same input (Granite-MoE's shared MLP next to the routed experts)
  is added to it: the site hooks the one that finishes last, adds the other's output
  (`Site.plus`), and an edit's change goes to the hooked one;
- only then, for a block that scales what it adds (Granite's `residual_multiplier`, MiniCPM's and
  ESM-C's depth scaling), per-sublayer constants fitted by least squares: the site is
  `c * output` (its description gives c) and an edit's change is divided by c on the way back,
  so a null edit stays bit-identical. In low precision a fitted constant is rounded to 1..7
  significant digits until one reproduces the block's own products and adds in its dtype (the
  real 0.22, not the least-squares 0.2199x that rounding noise gives);
- a block that restarts its residual and sums its sublayers alone (Inkling 2's block boundary,
  the stack keeping the input as a state) gets `resid_coef` 0, said in `resid_out`'s description.

A hybrid layer's temporal block that is attention in that layer counts once. Where nothing
holds, those sites are left out and `adapter.problems` says why, rather than giving activations
that are not the contribution.
"""

from __future__ import annotations

import functools
import itertools

import torch
from torch import nn

from conceptlens.adapters.padded import centre_offset
from conceptlens.adapters.probe_pass import Trace, close, sums_to
from conceptlens.adapters.streams import other_stream
from conceptlens.adapters.structure import BlockLayout
from conceptlens.adapters.verify import _contributions, _last_projection, _same, submodule, sum_problem


_KINDS = ("attn_out", "cross_attn_out", "mixer_out", "mlp_out", "branch_out")


def _scales(x: torch.Tensor, y: torch.Tensor, outs: dict[str, torch.Tensor], y0: torch.Tensor | None = None
            ) -> dict[str, float] | None:
    """Constants c_k with resid_in + sum(c_k * out_k) == resid_out (1e-4, the tolerance of the
    plain sum), fitted on the probe by least squares; None when no constants reproduce it. For a
    low-precision model (`y0`, the block output as recorded), where a least-squares fit on rounded
    terms is only near the block's constants, the fit rounded to 1..7 significant digits is kept
    if it reproduces the block's own rounding (`sums_to`: each product and add in the model's dtype)."""
    a = torch.stack([o.reshape(-1) for o in outs.values()], dim=1).double()
    b = (y - x).reshape(-1).double()
    if a.shape[0] <= 4 * a.shape[1] or torch.linalg.matrix_rank(a) < a.shape[1]:
        return None
    c = torch.linalg.lstsq(a, b[:, None]).solution[:, 0]
    if not bool(torch.isfinite(c).all()) or bool((c.abs() < 1e-3).any()):
        return None  # a sublayer fitted away: not a multiplier
    c = torch.where((c - 1).abs() < 1e-3, torch.ones_like(c), c)
    scales = {key: float(v) for key, v in zip(outs, c)}
    if close(x + sum(scales[k] * o for k, o in outs.items()), y, 1e-4):
        return scales
    if y0 is None or y0.dtype not in (torch.bfloat16, torch.float16):
        return None
    for digits in range(1, 8):  # a config constant (Granite's residual_multiplier 0.22) has few digits
        snapped = {k: float(f"{v:.{digits}g}") for k, v in scales.items()}
        if sums_to(x, [o.to(y0.dtype) * snapped[k] for k, o in outs.items()], y0):
            return snapped
    return None


def _alternatives(block: nn.Module, path: str, trace: Trace, shape, assigned=()) -> list[tuple[str, str | None, str]]:
    """Exact readings of one sublayer's contribution: (module path, path of a module whose
    output is added to it or None, note)."""
    alts: list[tuple[str, str | None, str]] = [(path, None, "")]
    inner = _last_projection(block, path, trace)
    if inner:
        alts.append((inner, None, f"{path} adds the residual inside itself"))
    module = submodule(block, path)
    out, inp = (trace.outputs.get(module), trace.inputs.get(module)) if module is not None else (None, None)
    for name, child in block.named_children():
        cin, cout = trace.inputs.get(child), trace.outputs.get(child)
        if child is module or cout is None or cout.shape != shape:
            continue
        if _same(cin, out):
            alts.append((name, None, f"{name} is applied to the output of {path}"))
        elif _same(cin, inp) and name not in assigned:  # hooked at whichever of the two finishes last
            order = list(trace.outputs)
            later = module in order and order.index(child) > order.index(module)
            first, second = (path, name) if later else (name, path)
            alts.append((second, first, f"plus the output of {first}, which runs beside it on the same input"))
    return alts


def _contribution(block, trace, x, path, plus, flat) -> torch.Tensor | None:
    total = None
    for p in (path, plus):
        if p is None:
            continue
        out = trace.outputs.get(submodule(block, p))
        if out is not None and flat and out.ndim == x.ndim - 1:
            out = out.view(*x.shape[:-1], -1)
        if out is not None and (offset := centre_offset(out, x)):  # run on the rows padded both sides
            out = out[:, offset:offset + x.shape[1]]
        if out is None or out.shape != x.shape:
            return None
        total = out.float() if total is None else total + out.float()
    return total


def repair(block: nn.Module, lay: BlockLayout, trace: Trace):
    """For an additive block whose sum fails, try exact readings of its sublayers: a sublayer
    that adds the residual inside itself is read at its output projection; a module applied to
    a sublayer's output (Inkling's short convolutions) or run beside it on the same input
    (Granite's shared MLP, summed) joins it; constant residual multipliers are fitted. Returns
    (problem or None, {kind: scale} or None, {kind: path of the module added to it}); on
    success `lay` and its notes describe the reading."""
    problem = sum_problem(block, lay, trace)
    x, y = trace.inputs.get(block), trace.outputs.get(block)
    kinds = [k for k in _KINDS if getattr(lay, k)]
    if problem is None or x is None or y is None or not kinds:
        return problem, None, None
    x0, y0, x, y = x, y, x.float(), y.float()  # as recorded (for sums_to), and in float32
    assigned = {getattr(lay, k) for k in kinds}  # another sublayer is never summed into this one
    options = [_alternatives(block, getattr(lay, k), trace, x.shape, assigned) +
               (_alternatives(block, lay.replaced[k], trace, x.shape, assigned) if k in lay.replaced else [])
               for k in kinds]
    combos = list(itertools.islice(itertools.product(*options), 256))
    for scaled in (False, True, None):  # every exact plain reading before any fitted multiplier; None:
        for combo in combos:  # a block that restarts its residual (resid_out = the sum of its sublayers)
            chosen = {k: c for k, c in zip(kinds, combo)}
            taken = {c[0] for c in combo if c[2]} | {c[1] for c in combo if c[1]}
            chosen = {k: c for k, c in chosen.items() if c[2] or getattr(lay, k) not in taken}  # a follower counts once
            read = {k: _contribution(block, trace, x, c[0], c[1], lay.flat_mlp and k == "mlp_out")
                    for k, c in chosen.items()}
            outs = {k: o for k, o in read.items() if o is not None}
            if not outs or len(outs) < len(read):
                continue
            scales = _scales(x, y, outs, y0) if scaled else None
            plain = scaled is False and sums_to(x0, list(outs.values()), y0)  # in the model's dtype too
            if scales or plain or (scaled is None and close(functools.reduce(torch.add, outs.values()), y, 1e-4)):
                lay.resid_coef = 1.0 if scaled is not None else 0.0
                _apply(lay, kinds, chosen)
                return None, scales, {k: c[1] for k, c in chosen.items() if c[1]}
    contributions = _contributions(block, lay, trace)
    if isinstance(contributions, dict) and other_stream(block, lay, contributions, trace):  # a reversible block (Reformer)
        return None, None, None
    return problem, None, None


def _apply(lay: BlockLayout, kinds: list[str], chosen: dict) -> None:
    for k in kinds:
        if k not in chosen:
            setattr(lay, k, None)
            continue
        path, _, note = chosen[k]
        if path != getattr(lay, k):
            lay.notes.pop(k, None)  # no longer after a post-sublayer norm
        setattr(lay, k, path)
        if note:
            lay.notes[k] = note
