"""One primitive for reading and editing a site: `hook_site(site, fn)`.

`fn` receives the site's tensor in the layout of the site table — `(B, T, d)` or
`(B, T, H, d_head)` — and returns None (read only) or a tensor of the same shape that
replaces it in the forward. Capture and steering are both built on this; every hook goes
through the model's HookManager (hooks/manager.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from conceptlens.hooks.attention import add_qkv_hook
from conceptlens.hooks.calls import gated_hook
from conceptlens.hooks.direct import channels_last, route_through_call
from conceptlens.hooks.handles import Handle, HandleGroup
from conceptlens.hooks.hyper import stream_hook
from conceptlens.sites.site import Site

if TYPE_CHECKING:
    from conceptlens.hooks.manager import HookManager

SiteFn = Callable[[Tensor], Tensor | None]


def hook_site(hooks: HookManager, site: Site, fn: SiteFn, *, edit: bool = False) -> Handle:
    """Register `fn` at `site` through `hooks`; the returned handle removes it.

    `edit=True` (steering) puts the hook before every other hook at the site, so edits at a
    site always run before reads there, whatever order the scopes were opened in. A site of
    one call of a shared layer (`site.call`) acts only during that call of each forward.
    """
    if site.first_call_in is not None:  # a module the block runs more than once: its first call only
        return gated_hook(hooks, site.module, site.first_call_in, 0, fn,
                          lambda gated: hook_site(hooks, replace(site, first_call_in=None), gated, edit=edit))
    if (site.trimmed or site.prefixed) and site.stack_module is not None or site.row_offset:
        lengths: list[int] = []
        group = HandleGroup()
        if (site.trimmed or site.prefixed) and site.stack_module is not None:
            group.add(hooks.pre_hook(site.stack_module, _record_length(lengths), with_kwargs=True))
        try:
            group.add(hook_site(hooks, replace(site, trimmed=False, prefixed=False, row_offset=0),
                                _trimmed(fn, lengths, site.prefixed, site.row_offset), edit=edit))
        except BaseException:
            group.remove()
            raise
        return group
    if site.routed:  # the stack calls the module's forward directly: route those calls through its hooks
        group = HandleGroup()
        group.add(route_through_call(hooks, site.module))
        try:
            group.add(hook_site(hooks, replace(site, routed=False), fn, edit=edit))
        except BaseException:
            group.remove()
            raise
        return group
    if site.channels_first:
        return hook_site(hooks, replace(site, channels_first=False, heads=None), channels_last(fn, site.heads),
                         edit=edit)
    if site.time_major:
        fn = _transposed(fn)
    if site.streams_first:
        fn = _streams_last(fn)
    if site.call is not None and site.block is not None and site.stack_module is not None:
        return gated_hook(hooks, site.block, site.stack_module, site.call, fn,
                          lambda gated: _hook(hooks, site, gated, edit))
    return _hook(hooks, site, fn, edit)


def _hook(hooks: HookManager, site: Site, fn: SiteFn, edit: bool) -> Handle:
    if isinstance(site.scale, Tensor) or site.scale != 1.0:
        fn = _scaled(fn, site.scale)
    if site.point == "pattern":
        if edit:
            raise ValueError(f"{site.name} is read only (attention probabilities); edit q or k instead")
        return add_qkv_hook(hooks, site.module, "pattern", fn, current=site.shape[3] != "S", key_layout=site.key_layout)
    if site.point in ("q", "k", "v"):
        # "T" in the sequence dimension: aligned with this forward's queries (self-attention)
        shape = tuple(site.shape[2:4]) if all(isinstance(s, int) for s in site.shape[2:4]) else None
        return add_qkv_hook(hooks, site.module, site.point, fn, current=site.shape[1] == "T", edit=edit, shape=shape,
                            key_layout=site.key_layout)
    if site.point == "input":
        return hooks.pre_hook(site.module, _input_hook(fn, site.heads), with_kwargs=True, prepend=edit)
    if site.expand is not None:
        return stream_hook(hooks, site, fn, edit)
    if site.part is not None:
        return hooks.forward_hook(site.module, _output_hook(_parted(fn, site.part, site.heads), None), prepend=edit)
    if site.flat_in is not None:
        return _flat_output_hook(hooks, site, fn, edit)
    if site.plus is not None:
        return _sum_output_hook(hooks, site, fn, edit)
    return hooks.forward_hook(site.module, _output_hook(fn, site.heads), prepend=edit)


def _record_length(lengths: list[int]):
    def hook(module, args, kwargs):
        x = kwargs.get("input_ids")
        x = x if x is not None else kwargs.get("inputs_embeds")
        x = x if x is not None or not args else args[0]
        lengths[:] = [int(x.shape[1])] if isinstance(x, Tensor) and x.ndim >= 2 else []

    return hook


def _trimmed(fn: SiteFn, lengths: list[int], last: bool = False, offset: int = 0) -> SiteFn:
    """`fn` sees the first T tokens (T: this forward's input length) of a tensor the model padded,
    the last T of one it prepended positions to (`last`), or the T after `offset` rows of padding
    (T: the rest less as much padding behind, where no length is recorded); an edit leaves the
    rest as it was."""
    def call(x: Tensor) -> Tensor | None:
        length = lengths[0] if lengths else x.shape[1] - 2 * offset
        if x.shape[1] <= length and not offset:
            return fn(x)
        start = x.shape[1] - length if last else offset
        new = fn(x[:, start:start + length])
        if new is None:
            return None
        return torch.cat([x[:, :start], new.to(x.dtype), x[:, start + length:]], dim=1)

    return call


def _streams_last(fn: SiteFn) -> SiteFn:
    """`fn` sees the `(B, T, n, d)` permutation of an `(n, B, T, d)` tensor; edits go back."""
    def call(x: Tensor) -> Tensor | None:
        if x.ndim != 4:
            return fn(x)
        new = fn(x.permute(1, 2, 0, 3))
        return None if new is None else new.permute(2, 0, 1, 3)

    return call


def _transposed(fn: SiteFn) -> SiteFn:
    """`fn` sees the `(B, T, ...)` transpose of a time-major `(T, B, ...)` tensor; edits go back."""
    def call(x: Tensor) -> Tensor | None:
        new = fn(x.transpose(0, 1))
        return None if new is None else new.transpose(0, 1)

    return call


def _scaled(fn: SiteFn, scale: float | Tensor) -> SiteFn:
    """`fn` sees `scale * x`; an edit comes back as x + (edited - scale * x) / scale, so an edit
    that changes nothing returns x bit for bit."""
    def call(x: Tensor) -> Tensor | None:
        factor = scale.to(x) if isinstance(scale, Tensor) else scale  # a per-channel factor: (d,)
        scaled = x * factor
        new = fn(scaled)
        return None if new is None else x + (new - scaled) / factor

    return call


def _parted(fn: SiteFn, part, heads: int | None) -> SiteFn:
    """`fn` sees one part of a fused projection's output, split into heads; an edit goes back into
    that part and leaves the others as they were."""
    def call(x: Tensor) -> Tensor | None:
        new = fn(part.take(x).unflatten(-1, (heads, -1)))
        return None if new is None else part.put(x, new.flatten(-2))

    return call


def _input_hook(fn: SiteFn, heads: int | None = None):
    def call(x: Tensor) -> Tensor | None:
        new = fn(x.unflatten(-1, (heads, -1)) if heads else x)  # (B, T, H * d) -> (B, T, H, d)
        return new.flatten(-2) if new is not None and heads else new

    def hook(module, args, kwargs):
        if args:
            new = call(args[0])
            return None if new is None else ((new, *args[1:]), kwargs)
        new = call(kwargs["hidden_states"])
        return None if new is None else (args, {**kwargs, "hidden_states": new})

    return hook


def _output_hook(fn: SiteFn, heads: int | None):
    def hook(module, args, output):
        key = next(iter(output)) if type(output) is dict else None  # SqueezeBERT's {"feature_map": ...}
        x = output[0] if isinstance(output, (tuple, list)) else output if key is None else output[key]
        shaped = x.unflatten(-1, (heads, -1)) if heads else x  # projection -> (B, T, H, d_head)
        new = fn(shaped)
        if new is None:
            return None
        if heads:
            new = new.flatten(-2)
        if key is not None:
            return {**output, key: new}
        if isinstance(output, (tuple, list)):
            rest = [new, *output[1:]]
            return output._make(rest) if hasattr(output, "_make") else type(output)(rest)  # a namedtuple
        return new

    return hook


def _flat_output_hook(hooks: HookManager, site: Site, fn: SiteFn, edit: bool = False) -> Handle:
    """For a module fed `(B * T, d)` rows: view its output as `(B, T, d)` for `fn`."""
    flat_in = site.flat_in
    if flat_in is None:
        raise ValueError(f"{site.name} is not read from flattened rows (no flat_in module)")
    batch_shape: list[torch.Size] = []

    def remember(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        batch_shape[:] = [x.shape[:-1]]

    def hook(module, args, output):
        x = output[0] if isinstance(output, tuple) else output
        new = fn(x.view(*batch_shape[0], -1))
        if new is None:
            return None
        new = new.reshape(x.shape)
        return (new, *output[1:]) if isinstance(output, tuple) else new

    group = HandleGroup()
    try:
        group.add(hooks.pre_hook(flat_in, remember, with_kwargs=True, prepend=True))
        group.add(hooks.forward_hook(site.module, hook, prepend=edit))
    except BaseException:
        group.remove()
        raise
    return group


def _sum_output_hook(hooks: HookManager, site: Site, fn: SiteFn, edit: bool = False) -> Handle:
    """For a site that is `module`'s output plus `site.plus`'s (a module on the same input, or a
    tuple of modules that finish before it: the other sublayers of its kind): `fn` sees the sum;
    an edit's change is added to `module`'s output (a null edit changes nothing)."""
    others = site.plus if isinstance(site.plus, tuple) else () if site.plus is None else (site.plus,)
    seen: dict[int, Tensor] = {}

    def remember(index: int):
        def hook(module, args, output):
            seen[index] = output[0] if isinstance(output, (tuple, list)) else output

        return hook

    def call(x: Tensor) -> Tensor | None:
        missing = [m for i, m in enumerate(others) if i not in seen]
        if missing:  # `plus` finishes after `module`: the sum is formed at its output instead
            raise RuntimeError(f"{site.name}: {type(missing[0]).__name__} did not run before {type(site.module).__name__}")
        total = x
        for i in range(len(others)):
            total = total + seen.pop(i)
        new = fn(total)
        return None if new is None else x + (new - total)

    group = HandleGroup()
    try:
        for i, other in enumerate(others):
            group.add(hooks.forward_hook(other, remember(i), prepend=True))
        group.add(hooks.forward_hook(site.module, _output_hook(call, site.heads), prepend=edit))
    except BaseException:
        group.remove()
        raise
    return group
