"""Blocks with more sublayers than one attention and one MLP, read exactly from the probe.

Two structural readings, tried only where `resid_in + attn_out + mlp_out` misses `resid_out`
(pure functions over the probe trace, called before `verify.repair`):

- several sublayers of one kind run in turn (LongCat-Flash keeps two attentions in
  `self_attn[0..1]`, two MLPs in `mlps[0..1]` beside a shortcut MoE `mlp`): the kind's site is
  the sum of their outputs, hooked at the one that finishes last, which also gets an edit's
  change (`BlockLayout.parts`); each attention sublayer after the first gets its own
  q/k/v/pattern/z sites (`blocks.i.attn_1.q`, ...);
- a further branch the block adds beside attention and MLP (Gemma 4's per-layer-input branch,
  added after the MLP): `branch_out`, the child of the block whose output closes the sum, tried
  with each sublayer also read at a later child (Gemma 4's MoE layers norm the sum of the dense
  MLP and the experts: the MLP's contribution is that norm's output).

Each is kept only if the sum then holds on the probe at the tolerance of the plain sum (1e-4),
or, where no plain reading does, with constant coefficients on the residual and the sublayers
(Gemma 4 multiplies its block output by `layer_scalar`); which sites such a block gets, and
under which equation, `verify.repair` decides as for any block.

Summing was chosen over splitting such a layer into two blocks: HF lists one hidden state per
layer, the mid-layer residual is no module's output (so a `resid` edit there could not be exact)
and the shortcut MoE crosses the split. An HF module path naming one summed sublayer maps to no
site. A further attention's k/v are refused under a cache like the first's (latent attention).
Where Gemma 4's `layer_scalar` is not 1, the block gets the residual coefficient s like any block
that scales its residual (`resid_out = s * resid_in + attn_out + mlp_out + branch_out`, each site
s times its module's output).
"""

from __future__ import annotations

import torch
from torch import nn

from conceptlens.adapters.probe_pass import Trace, close
from conceptlens.adapters.structure import _OUT_PROJ, BlockLayout, _child, _join, _kind, is_norm
from conceptlens.adapters.verify import _contributions, _same, submodule, sum_problem

_KIND_OF = {"attn": "attn_out", "cross": "cross_attn_out", "mixer": "mixer_out", "mlp": "mlp_out"}
_KINDS = ("attn_out", "cross_attn_out", "mixer_out", "mlp_out")
_WORD = {"attn_out": "attention", "cross_attn_out": "cross-attention", "mixer_out": "mixer", "mlp_out": "MLP"}


def extend(block: nn.Module, lay: BlockLayout, trace: Trace) -> None:
    """Make the sum of an additive block hold with summed parts or a further branch, if any does."""
    if sum_problem(block, lay, trace) is None:
        return
    _gather_parts(block, lay, trace)
    if not _holds(block, lay, trace, loose=True):
        _find_branch(block, lay, trace)


def _members(block: nn.Module, trace: Trace, shape) -> dict[str, list[str]]:
    """Site kind -> paths of the block's sublayers of that kind that ran with residual-shaped
    output (children, and members of a ModuleList child whose members are all of one kind), for
    the kinds that have such a list (two sublayers beside each other without one, e.g. a shared
    MLP next to the routed experts, are `verify.repair`'s)."""
    found: dict[str, list[str]] = {}
    listed: set[str] = set()
    for name, child in block.named_children():
        if isinstance(child, nn.ModuleList):
            kinds = {_kind(name, m) for m in child}
            items = [(f"{name}.{j}", m) for j, m in enumerate(child)] if len(kinds) == 1 else []
            kind = kinds.pop() if len(kinds) == 1 else None
        else:
            items, kind = [(name, child)], _kind(name, child)
        if kind not in _KIND_OF:
            continue
        if isinstance(child, nn.ModuleList):
            listed.add(_KIND_OF[kind])
        for path, module in items:
            out = trace.outputs.get(module)
            if out is not None and out.shape == shape:
                found.setdefault(_KIND_OF[kind], []).append(path)
    return {k: v for k, v in found.items() if k in listed}


def _gather_parts(block: nn.Module, lay: BlockLayout, trace: Trace) -> None:
    x = trace.inputs.get(block)
    if x is None:
        return
    order = {m: i for i, m in enumerate(trace.outputs)}  # the trace keeps the order modules finished in
    saved = {k: getattr(lay, k) for k in _KINDS}
    changed = []
    for key, paths in _members(block, trace, x.shape).items():
        current = getattr(lay, key)
        listed = isinstance(submodule(block, current), nn.ModuleList)
        if len(paths) < 2 or not (listed or current in paths):
            continue  # one sublayer of this kind, or one replaced by a post-sublayer norm: not ours
        paths = sorted(paths, key=lambda p: order[block.get_submodule(p)])  # paths of modules that ran
        setattr(lay, key, paths[-1])
        lay.parts[key] = tuple(paths[:-1])
        changed.append(key)
    if not changed:
        return
    if not _holds(block, lay, trace, loose=True):
        for key in changed:
            lay.parts.pop(key, None)
        for key, path in saved.items():
            setattr(lay, key, path)
        return
    for key in changed:
        others, last = lay.parts[key], getattr(lay, key)
        lay.notes[key] = (f"plus the output of {' and '.join(others)}: the sum of the block's {len(others) + 1} "
                          f"{_WORD[key]} sublayers, as added to the residual; an edit's change goes "
                          f"to {last}, the last of them to run")


def _find_branch(block: nn.Module, lay: BlockLayout, trace: Trace) -> None:
    x = trace.inputs.get(block)
    if x is None:
        return
    order = list(trace.outputs)
    taken = {getattr(lay, k) for k in _KINDS} | set(lay.replaced.values()) | \
        {p for parts in lay.parts.values() for p in parts}
    # a module on a sublayer's input or output is `verify.repair`'s (run beside it, or applied to it)
    near = [t for k in _KINDS if (m := submodule(block, getattr(lay, k))) is not None
            for t in (trace.inputs.get(m), trace.outputs.get(m))]
    pool = [name for name, child in block.named_children()
            if name not in taken and child in trace.outputs and trace.outputs[child].shape == x.shape
            and not (is_norm(name, child) and _same(trace.inputs.get(child), x))
            and not any(_same(trace.inputs.get(child), t) for t in near)]
    kinds = [k for k in _KINDS if getattr(lay, k)]
    moves = [(None, None)] + [(k, p) for k in kinds for p in _later(block, getattr(lay, k), pool, order)]
    for loose in (False, True):  # every plain reading before one that needs constant coefficients
        for key, path in moves:
            old = getattr(lay, key) if key else None
            if key:
                setattr(lay, key, path)
            for name in pool:
                lay.branch_out = name if name != path else None
                if lay.branch_out and _holds(block, lay, trace, loose):
                    lay.notes["branch_out"] = ("a further branch that the block adds to the residual "
                                               "beside its attention and MLP")
                    if key:
                        lay.notes[key] = f"{path}, which finishes after {old}, gives what that sublayer adds " \
                                         "to the residual"
                    return
            lay.branch_out = None
            if key:
                setattr(lay, key, old)


def _holds(block: nn.Module, lay: BlockLayout, trace: Trace, loose: bool) -> bool:
    """The block's sum holds on the probe: plainly, or (`loose`) with constant coefficients on
    resid_in and on each sublayer, `c0 * resid_in + sum(c_k * out_k) == resid_out` (fitted by least
    squares, 1e-4), as in a block that scales its output (Gemma 4's `layer_scalar`). Which sites
    such a block then gets is decided later (`verify.repair`), as for any block."""
    if sum_problem(block, lay, trace) is None:
        return True
    outs = _contributions(block, lay, trace) if loose else None
    x, y = trace.inputs.get(block), trace.outputs.get(block)
    if not outs or isinstance(outs, str) or x is None or y is None or x.shape != y.shape:
        return False
    a = torch.stack([x.float().reshape(-1)] + [o.reshape(-1) for o in outs.values()], dim=1).double()
    b = y.float().reshape(-1, 1).double()
    if a.shape[0] <= 4 * a.shape[1] or torch.linalg.matrix_rank(a) < a.shape[1]:
        return False
    c = torch.linalg.lstsq(a, b).solution
    if not bool(torch.isfinite(c).all()) or bool((c.abs() < 1e-3).any()):
        return False  # the residual or a sublayer fitted away: not a coefficient
    return close((a @ c).float(), b.float(), 1e-4)


def _later(block: nn.Module, path: str, pool: list[str], order: list[nn.Module]) -> list[str]:
    """Children in `pool` that finish after the sublayer at `path`, in the order they finish."""
    module = submodule(block, path)
    start = order.index(module) if module in order else len(order)
    return sorted((p for p in pool if order.index(block.get_submodule(p)) > start),
                  key=lambda p: order.index(block.get_submodule(p)))


def plus_modules(block: nn.Module, lay: BlockLayout, kind: str, plus: dict | None):
    """What a site's hook adds to its module's output: the kind's other parts and any module run
    beside it (`verify.repair`); one module, a tuple of them, or None."""
    paths = list(dict.fromkeys([*lay.parts.get(kind, ()), *([plus[kind]] if plus and kind in plus else [])]))
    modules = tuple(block.get_submodule(p) for p in paths)
    return None if not modules else modules[0] if len(modules) == 1 else modules


def more_attention(block: nn.Module, lay: BlockLayout, trace: Trace) -> list[str]:
    """Paths of the modules calling the attention function in each summed attention sublayer
    after the one holding `lay.attn` (LongCat-Flash's `self_attn.1`), in the order they run."""
    first = submodule(block, lay.attn)
    sublayers = [s for p in (*lay.parts.get("attn_out", ()), lay.attn_out) if (s := submodule(block, p)) is not None]
    if first is None or len(sublayers) < 2:
        return []
    names = {m: n for n, m in block.named_modules()}
    found: list[str] = []
    for sub in sublayers:
        inside = set(sub.modules())
        if first in inside:
            continue
        call = next((c for c in trace.attention if c.module in inside and c.q_len == c.k_len), None)
        if call is not None:
            found.append(names[call.module])
    return found


def out_projection(block: nn.Module, path: str | None) -> str | None:
    """Path of the output projection of the attention module at `path` (its input is `attn.z`)."""
    module = submodule(block, path)
    return None if module is None else _join(path, _child(module, _OUT_PROJ))
