"""Blocks with more sublayers than one attention and one MLP, read exactly from the probe.

Two structural readings, tried only where `resid_in + attn_out + mlp_out` misses `resid_out`
(pure functions over the probe trace, called before `verify.repair`):

- several sublayers of one kind run in turn (LongCat-Flash keeps two attentions in
  `self_attn[0..1]`, two MLPs in `mlps[0..1]` beside a shortcut MoE `mlp`): the kind's site is
  the sum of their outputs, hooked at the one that finishes last, which also gets an edit's
  change (`BlockLayout.parts`); every self-attention module after the first gets its own q/k/v
  sites (`blocks.i.attn_1.q`, ...);
- a further branch the block adds beside attention and MLP (Gemma 4's per-layer-input branch,
  added after the MLP): `branch_out`, the child of the block whose output closes the sum, tried
  with each sublayer also read at a later child (Gemma 4's MoE layers norm the sum of the dense
  MLP and the experts: the MLP's contribution is that norm's output).

Each is kept only if the sum then holds on the probe at the tolerance of the plain sum.
"""

from __future__ import annotations

from torch import nn

from conceptlens.adapters.probe import Trace
from conceptlens.adapters.structure import BlockLayout, _kind, is_norm
from conceptlens.adapters.verify import _same, submodule, sum_problem

_KIND_OF = {"attn": "attn_out", "cross": "cross_attn_out", "mixer": "mixer_out", "mlp": "mlp_out"}
_KINDS = ("attn_out", "cross_attn_out", "mixer_out", "mlp_out")
_WORD = {"attn_out": "attention", "cross_attn_out": "cross-attention", "mixer_out": "mixer", "mlp_out": "MLP"}


def extend(block: nn.Module, lay: BlockLayout, trace: Trace) -> None:
    """Make the sum of an additive block hold with summed parts or a further branch, if any does."""
    if sum_problem(block, lay, trace) is None:
        return
    _gather_parts(block, lay, trace)
    if sum_problem(block, lay, trace) is not None:
        _find_branch(block, lay, trace)


def _members(block: nn.Module, trace: Trace, shape) -> dict[str, list[str]]:
    """Site kind -> paths of the block's sublayers of that kind that ran with residual-shaped
    output (children, and members of a ModuleList child whose members are all of one kind)."""
    found: dict[str, list[str]] = {}
    for name, child in block.named_children():
        if isinstance(child, nn.ModuleList):
            kinds = {_kind(name, m) for m in child}
            items = [(f"{name}.{j}", m) for j, m in enumerate(child)] if len(kinds) == 1 else []
            kind = kinds.pop() if len(kinds) == 1 else None
        else:
            items, kind = [(name, child)], _kind(name, child)
        if kind not in _KIND_OF:
            continue
        for path, module in items:
            out = trace.outputs.get(module)
            if out is not None and out.shape == shape:
                found.setdefault(_KIND_OF[kind], []).append(path)
    return found


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
        paths = sorted(paths, key=lambda p: order[submodule(block, p)])
        setattr(lay, key, paths[-1])
        lay.parts[key] = tuple(paths[:-1])
        changed.append(key)
    if not changed:
        return
    if sum_problem(block, lay, trace) is not None:
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
    pool = [name for name, child in block.named_children()
            if name not in taken and child in trace.outputs and trace.outputs[child].shape == x.shape
            and not (is_norm(name, child) and _same(trace.inputs.get(child), x))]
    kinds = [k for k in _KINDS if getattr(lay, k)]
    for key, path in [(None, None)] + [(k, p) for k in kinds for p in _later(block, getattr(lay, k), pool, order)]:
        old = getattr(lay, key) if key else None
        if key:
            setattr(lay, key, path)
        for name in pool:
            if name == path:
                continue
            lay.branch_out = name
            if sum_problem(block, lay, trace) is None:
                lay.notes["branch_out"] = ("a further branch that the block adds to the residual "
                                           "beside its attention and MLP")
                if key:
                    lay.notes[key] = f"{path}, which finishes after {old}, gives what that sublayer adds to the residual"
                return
        lay.branch_out = None
        if key:
            setattr(lay, key, old)


def _later(block: nn.Module, path: str, pool: list[str], order: list[nn.Module]) -> list[str]:
    """Children in `pool` that finish after the sublayer at `path`, in the order they finish."""
    module = submodule(block, path)
    start = order.index(module) if module in order else len(order)
    return sorted((p for p in pool if order.index(block.get_submodule(p)) > start),
                  key=lambda p: order.index(block.get_submodule(p)))


def plus_modules(block: nn.Module, lay: BlockLayout, kind: str, plus: dict | None):
    """What a site's hook adds to its module's output: the kind's other parts and any module run
    beside it (`verify.repair`); one module, a tuple of them, or None."""
    paths = [*lay.parts.get(kind, ()), *([plus[kind]] if plus and kind in plus else [])]
    modules = tuple(block.get_submodule(p) for p in paths)
    return None if not modules else modules[0] if len(modules) == 1 else modules


def more_attention(block: nn.Module, lay: BlockLayout, trace: Trace) -> list[str]:
    """Paths of the modules calling the attention function in each summed attention sublayer
    after the one holding `lay.attn` (LongCat-Flash's `self_attn.1`), in the order they run."""
    first = submodule(block, lay.attn)
    sublayers = [submodule(block, p) for p in (*lay.parts.get("attn_out", ()), lay.attn_out)]
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
