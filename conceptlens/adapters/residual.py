"""Blocks whose update scales or interpolates the residual itself, detected and verified on the probe.

Tried only where the plain sum and fitted sublayer multipliers (`verify.repair`) fail, in this
order, each kept only if it reproduces the probe at the sum's tolerance (1e-4):

* *a coefficient on the residual*: resid_out = c0 * r + sum(c_k * out_k) with constants fitted by
  least squares (Beam's depth-scaled adds), r the block input or the output of a norm that reads it
  (RWKV's block 0 normalises its input before its residual: resid_in is then that norm's output).
  The block stays additive in the generalised sense: `c0 * resid_in + sum(sites) == resid_out`.
* *a chain of residual adds*: each sublayer's output enters one add `t = a * s + b * out_k`, where
  s and t are the block's input / output or a norm's input / output in the block, and a, b are
  constants or per-channel constant vectors (MiniMax adds its sublayers to the *normed* input and
  norms again, DeepNorm-style; Dory interpolates at learned per-channel rates). The site is
  `b * out_k`, what that add adds; the block is not additive in resid_in.

Either way a site's edit changes the sublayer's output by its change divided by the factor
(`hooks.points._scaled`), so the add's result moves by exactly the edit's change. The factors
come from the weights at attach: attach again after changing them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from conceptlens.adapters.probe_pass import Trace, close
from conceptlens.adapters.structure import BlockLayout, is_norm
from conceptlens.adapters.verify import _contributions, submodule

Point = tuple[str, str]
"""(path of a module in the block, "input" | "output"); path "" is the block itself."""


@dataclass(frozen=True)
class ResidualAdd:
    """`target = coef * source + the sites in kinds`, verified on the probe."""

    kinds: tuple[str, ...]
    target: Point
    source: Point
    coef: float | Tensor
    """A constant, or one per channel (a `(d,)` tensor)."""
    how: str = ""
    """How per-channel factors were found ("affine in |lambda_1|"), "" for constants."""


def refit(block: nn.Module, lay: BlockLayout, trace: Trace) -> dict[str, float | Tensor] | None:
    """Scales of the sublayer sites under a residual coefficient or a chain of adds (recorded in
    `lay`), or None when neither reproduces the block."""
    outs = _contributions(block, lay, trace)
    x, y = trace.inputs.get(block), trace.outputs.get(block)
    if isinstance(outs, str) or not outs or x is None or y is None or x.shape != y.shape:
        return None
    linear = _linear(block, lay, trace, outs)
    return linear if linear is not None else _chain(block, lay, trace, outs)


def _norms(block: nn.Module, trace: Trace) -> list[str]:
    """Norm children that ran, in the order they finished."""
    names = {m: n for n, m in block.named_children() if is_norm(n, m)}
    return [names[m] for m in trace.outputs if m in names]


def _tensor(block: nn.Module, trace: Trace, point: Point) -> Tensor | None:
    module = block if not point[0] else submodule(block, point[0])
    if module is None:
        return None
    out = (trace.inputs if point[1] == "input" else trace.outputs).get(module)
    return None if out is None else out.float()


def _same(a: Tensor | None, b: Tensor) -> bool:
    return a is not None and a.shape == b.shape and torch.equal(a, b)


def _snap(c: float) -> float:
    return 1.0 if abs(c - 1.0) < 1e-5 else c


def _linear(block, lay, trace, outs) -> dict[str, float | Tensor] | None:
    x, y = _tensor(block, trace, ("", "input")), _tensor(block, trace, ("", "output"))
    if x is None or y is None:
        return None
    sources = [("", "input")] + [(n, "output") for n in _norms(block, trace)
                                 if _same(_tensor(block, trace, (n, "input")), x)]
    for source in sources:
        r = _tensor(block, trace, source)
        if r is None or r.shape != x.shape:
            continue
        a = torch.stack([r.reshape(-1)] + [o.reshape(-1) for o in outs.values()], dim=1).double()
        if a.shape[0] <= 4 * a.shape[1] or torch.linalg.matrix_rank(a) < a.shape[1]:
            continue
        c = torch.linalg.lstsq(a, y.reshape(-1, 1).double()).solution[:, 0]
        if not bool(torch.isfinite(c).all()) or bool((c.abs() < 1e-3).any()):
            continue
        c0, *cs = (_snap(float(v)) for v in c)
        scales: dict[str, float | Tensor] = dict(zip(outs, cs))
        if close(c0 * r + sum(scales[k] * o for k, o in outs.items()), y, 1e-4):
            lay.resid_coef, lay.resid_in = c0, source[0] or None
            if source[0]:
                lay.style += f", its input normalised by {source[0]} before its residual: resid_in is that output"
            return {} if c0 == 1.0 and all(c == 1.0 for c in cs) else scales
    return None


def _factors(block: nn.Module, s: Tensor, o: Tensor, t: Tensor):
    """(a, b, how) with t = a * s + b * o over every row: constants, or per-channel factors affine
    in one of the block's own per-channel parameters or its absolute value (Dory's rates
    |lambda * scale|), each fitted by least squares over all rows; None when none holds."""
    d = t.shape[-1]
    s, o, t = s.reshape(-1, d).double(), o.reshape(-1, d).double(), t.reshape(-1, d).double()
    bases = [(None, "")] + [(g(p.detach().double().to(t.device)), f"affine in {h.format(n)}")
                            for n, p in block.named_parameters(recurse=False) if p.ndim == 1 and p.numel() == d
                            for g, h in ((torch.abs, "|{}|"), (lambda v: v, "{}"))]
    for g, how in bases:
        cols = [s, o] if g is None else [s, g * s, o, g * o]
        m = torch.stack([c.reshape(-1) for c in cols], dim=1)
        if m.shape[0] <= 4 * m.shape[1] or torch.linalg.matrix_rank(m) < m.shape[1]:
            continue
        c = torch.linalg.lstsq(m, t.reshape(-1, 1)).solution[:, 0]
        if not bool(torch.isfinite(c).all()):
            continue
        if g is None:
            a, b = _snap(float(c[0])), _snap(float(c[1]))
        else:
            a, b = (c[0] + c[1] * g).float(), (c[2] + c[3] * g).float()
        if close(a * s + b * o, t, 1e-4):
            return a, b, how
    return None


def _constant(v: Tensor) -> float | Tensor:
    """A scalar when every channel has the same factor (to 1e-6), else the vector."""
    if float(v.max() - v.min()) <= 1e-6 * (1 + float(v.abs().max())):
        return _snap(float(v.mean()))
    return v


def _chain(block, lay, trace, outs) -> dict[str, float | Tensor] | None:
    order = list(trace.outputs)
    kinds = sorted(outs, key=lambda k: order.index(submodule(block, getattr(lay, k))))
    norms = _norms(block, trace)
    targets = [(n, "input") for n in norms] + [("", "output")]
    time = {n: order.index(submodule(block, n)) for n in norms}
    adds, scales, used = [], {}, set()
    for k in kinds:
        done = order.index(submodule(block, getattr(lay, k)))
        found = None
        for t in targets:
            if t in used or (t[0] and order.index(submodule(block, t[0])) < done):
                continue  # a target is formed after the sublayer's output
            sources = [(n, w) for n in reversed(norms) if time[n] < done for w in ("output", "input")] + [("", "input")]
            found = next((f for s in sources if s != t and (f := _add(block, trace, s, t, outs[k]))), None)
            if found:
                used.add(t)
                break
        if found is None:
            return None
        adds.append(ResidualAdd((k,), t, found[0], found[1], found[3]))
        b = found[2]
        scales[k] = b
    if adds[-1].target != ("", "output"):
        return None
    lay.adds, lay.additive = adds, False
    lay.style += ", a chain of scaled residual adds: " + equation(lay)
    return scales


def _add(block, trace, source: Point, target: Point, out: Tensor):
    s, t = _tensor(block, trace, source), _tensor(block, trace, target)
    if s is None or t is None or s.shape != out.shape or t.shape != out.shape or torch.equal(s, t):
        return None
    fit = _factors(block, s, out, t)
    if fit is None:
        return None
    a, b, how = fit
    big = (lambda v: v.abs().max()) if isinstance(a, Tensor) else abs
    small = (lambda v: float(v.abs().min())) if isinstance(b, Tensor) else abs
    if float(big(a)) < 1e-3 or small(b) < 1e-6:
        return None  # no residual kept, or a channel the sublayer cannot move (an edit there could not be exact)
    return source, _constant(a) if isinstance(a, Tensor) else a, _constant(b) if isinstance(b, Tensor) else b, how


def fmt(c: float | Tensor) -> str:
    if isinstance(c, Tensor):
        return f"a per-channel factor (from {float(c.min()):.6g} to {float(c.max()):.6g})"
    return f"{c:.6g}"


def _name(point: Point) -> str:
    if not point[0]:
        return "resid_in" if point[1] == "input" else "resid_out"
    return f"{point[0]}'s {point[1]}"


def equation(lay: BlockLayout) -> str:
    """The block's equation in words, where it is not resid_in + sum of the sublayer sites."""
    if lay.adds:
        return "; ".join(f"{_name(a.target)} = {fmt(a.coef)} * {_name(a.source)} + {' + '.join(a.kinds)}"
                         for a in lay.adds)
    if lay.resid_coef != 1.0:
        kinds = [k for k in ("attn_out", "cross_attn_out", "mixer_out", "mlp_out", "branch_out") if getattr(lay, k)]
        return f"resid_out = {fmt(lay.resid_coef)} * resid_in + {' + '.join(kinds)}"
    return ""


def before(lay: BlockLayout, prefix: str = "") -> str:
    """For `embed` where block 0 normalises its input before its residual (`prefix`: "decoder.", ...)."""
    return f" (before its {lay.resid_in}; {prefix}blocks.0.resid_in is that norm's output)" if lay.resid_in else ""


def sublayer_note(lay: BlockLayout, kind: str, scales: dict | None, scale: float | Tensor) -> str:
    """What the `kind` sublayer site adds to the residual, for its description (`scales`: the
    block's fitted scaling of each site, `scale` this one's)."""
    if scales:
        return (lay.notes[kind] + "; " if kind in lay.notes else "") + \
            f"times {fmt(scale)}, the block's scaling of it: {added(lay, kind)}"
    note = lay.notes.get(kind) or ("what it adds to the residual" if lay.additive else "")
    return note + (f"; the block does not add its input: {equation(lay)}" if lay.resid_coef == 0.0 else "")


def added(lay: BlockLayout, kind: str) -> str:
    """What a scaled site is, for its description."""
    if lay.adds:
        add = next(a for a in lay.adds if kind in a.kinds)
        how = f" (factors {add.how}, fitted at attach)" if add.how else ""
        return f"what it adds in {_name(add.target)} = {fmt(add.coef)} * {_name(add.source)} + {kind}{how}"
    eq = equation(lay)
    return "what it adds to the residual" + (f" ({eq})" if eq else "")
