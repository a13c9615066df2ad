"""One primitive for reading and editing a site: `hook_site(site, fn)`.

`fn` receives the site's tensor in the layout of the site table — `(B, T, d)` or
`(B, T, H, d_head)` — and returns None (read only) or a tensor of the same shape that
replaces it in the forward. Capture and steering are both built on this; every hook goes
through the model's HookManager (hooks/manager.py).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Callable

from torch import nn

from conceptlens.hooks.attention import add_qkv_hook, set_key_layout
from conceptlens.hooks.calls import gated_hook
from conceptlens.hooks.routed import route_through_call
from conceptlens.hooks.handles import Handle, HandleGroup
from conceptlens.hooks.hyper import StreamState, stream_state
from conceptlens.sites.hooked_views import Expansion
from conceptlens.sites.site import Site
from conceptlens.sites.views import Register, Removable, SiteFn

if TYPE_CHECKING:
    from conceptlens.hooks.manager import HookManager


def hook_site(hooks: HookManager, site: Site, fn: SiteFn, *, edit: bool = False) -> Handle:
    """Register `fn` at `site` through `hooks`; the returned handle removes it.

    The site's views are composed around `fn`, the first nearest the module, and one hook is
    registered at the site's point (plus what the views ask for: sites/views.py). `edit=True`
    (steering) puts that hook before every other hook at the site, so edits at a site always run
    before reads there, whatever order the scopes were opened in.
    """
    if site.point == "pattern" and edit:
        raise ValueError(f"{site.name} is read only (attention probabilities); edit q or k instead")
    tools = _ViewHooks(hooks)
    register: Register = lambda f: _hook_point(hooks, site, f, edit)  # noqa: E731
    for view in site.views:  # each registers through those nearer the module
        register = partial(view.attach, tools, site, register=register)
    return register(fn)  # type: ignore[return-value]


class _ViewHooks:
    """What a view may ask for (sites.views.ViewHooks), on the model's HookManager."""

    def __init__(self, manager: HookManager) -> None:
        self.manager = manager
        self.pre_hook = manager.pre_hook

    def forward_hook(self, module: nn.Module, fn: Callable, *, prepend: bool = False) -> Handle:
        return self.manager.forward_hook(module, fn, prepend=prepend)

    def group(self, *steps: Callable[[], Removable]) -> Handle:
        group = HandleGroup()
        try:
            for step in steps:
                group.add(step())
        except BaseException:
            group.remove()
            raise
        return group

    def gated(self, block: nn.Module, stack: nn.Module, call: int, fn: SiteFn, register: Register) -> Handle:
        return gated_hook(self.manager, block, stack, call, fn, register)

    def routed(self, module: nn.Module) -> Handle:
        return route_through_call(self.manager, module)

    def streams(self, module: nn.Module, expansion: Expansion) -> StreamState:
        return stream_state(self.manager, module, expansion)

    def key_layout(self, module: nn.Module, kind: str) -> Handle:
        return set_key_layout(self.manager, module, kind)


def _hook_point(hooks: HookManager, site: Site, fn: SiteFn, edit: bool) -> Handle:
    """One hook at the site's point, handing `fn` the module's tensor there."""
    if site.point == "pattern":
        return add_qkv_hook(hooks, site.module, "pattern", fn, current=site.shape[3] != "S")
    if site.point in ("q", "k", "v"):
        # "T" in the sequence dimension: aligned with this forward's queries (self-attention)
        shape = (int(site.shape[2]), int(site.shape[3])) if all(isinstance(s, int) for s in site.shape[2:4]) \
            else None
        return add_qkv_hook(hooks, site.module, site.point, fn, current=site.shape[1] == "T", edit=edit, shape=shape)
    if site.point == "input":
        return hooks.pre_hook(site.module, _input_hook(fn), with_kwargs=True, prepend=edit)
    return hooks.forward_hook(site.module, _output_hook(fn), prepend=edit)


def _input_hook(fn: SiteFn):
    def hook(module, args, kwargs):
        if args:
            new = fn(args[0])
            return None if new is None else ((new, *args[1:]), kwargs)
        new = fn(kwargs["hidden_states"])
        return None if new is None else (args, {**kwargs, "hidden_states": new})

    return hook


def _output_hook(fn: SiteFn):
    def hook(module, args, output):
        key = next(iter(output)) if type(output) is dict else None  # SqueezeBERT's {"feature_map": ...}
        x = output[0] if isinstance(output, (tuple, list)) else output if key is None else output[key]
        new = fn(x)
        if new is None:
            return None
        if key is not None:
            return {**output, key: new}
        if isinstance(output, (tuple, list)):
            rest = [new, *output[1:]]
            return output._make(rest) if hasattr(output, "_make") else type(output)(rest)  # a namedtuple
        return new

    return hook
