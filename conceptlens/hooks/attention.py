"""Hooks on q/k/v as the attention function receives them (after rotary embedding).

Post-rotary q and k are outputs of no module. Attention modules in transformers v5 look
up their kernel in `ALL_ATTENTION_FUNCTIONS` by `config._attn_implementation` at every
call, so while at least one q/k/v hook exists we register, under that name, a wrapper that
runs the hooks of the calling module and then the original kernel. Modules without hooks
pass straight through; when the last hook goes, the registry is restored exactly. The tables
live on the model's HookManager (hooks/manager.py), which also owns the registry entry.

    handle = add_qkv_hook(hooks, model.model.layers[3].self_attn, "k", fn)   # fn((B, T, H, d)) -> None | tensor
    handle.remove()
"""

from __future__ import annotations

import sys
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, cast
from weakref import WeakSet

import torch
from torch import Tensor, nn

from conceptlens.hooks import kv_cache, split_keys
from conceptlens.hooks.handles import Handle
from conceptlens.hooks.pattern import eager_pattern

if TYPE_CHECKING:
    from conceptlens.hooks.manager import HookManager

QKVHook = Callable[[Tensor], Tensor | None]
_INDEX = MappingProxyType({"q": 0, "k": 1, "v": 2, "pattern": 3})


def _global_entry(name: str) -> Callable | None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return cast("Callable | None", ALL_ATTENTION_FUNCTIONS._global_mapping.get(name))  # typed as `function`


def _eager_of(module: nn.Module) -> Callable:
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(f"{type(module).__name__} uses eager attention but its module defines no "
                           "eager_attention_forward; its q/k/v cannot be hooked")
    return fn


def _wrap(manager: HookManager, name: str, previous: Callable[[], Callable | None]) -> Callable:
    """This manager's registry entry. Entries of several lenses on one model chain (the later above);
    the top one runs every lens's edits, then every lens's reads, earlier lenses first, then the
    kernel: a lens reads the edits of another as it reads its own (DESIGN.md, "Order")."""
    def run(module: nn.Module, qkv: list[Tensor], args: tuple, kwargs: dict, edits: bool) -> list[Tensor]:
        lower = getattr(previous(), "__conceptlens_run__", None)
        if lower is not None:  # a lens attached before this one
            qkv = lower(module, qkv, args, kwargs, edits)
        if edits:
            for observe in list(manager.observers):
                observe(module, *qkv, kwargs)
        hooks = [h for h in manager.qkv.get(module, ()) if (h in manager.qkv_edits) == edits]
        return _run_hooks(manager, hooks, qkv, args, kwargs, module, name) if hooks else qkv

    def kernel(module: nn.Module) -> Callable:
        below = previous()
        lower = getattr(below, "__conceptlens_kernel__", None)
        return lower(module) if lower is not None else below or _global_entry(name) or _eager_of(module)

    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, *args, **kwargs):
        qkv = run(module, [query, key, value], args, kwargs, True)
        qkv = run(module, qkv, args, kwargs, False)
        return kernel(module)(module, *qkv, *args, **kwargs)

    setattr(attention, "__conceptlens_run__", run)
    setattr(attention, "__conceptlens_kernel__", kernel)
    return attention


def _run_hooks(manager: HookManager, hooks: list, qkv: list[Tensor], args: tuple, kwargs: dict,
               module: nn.Module, implementation: str) -> list[Tensor]:
    length = qkv[0].shape[2]
    state = manager.kv_calls.get(module)
    layout = manager.key_layouts.get(module, "")
    own = split_keys.own_length(module, layout, length, state)  # None: the keys end with this call's tokens
    for entry in sorted(hooks, key=lambda h: h[0] == 3):  # patterns after every q/k edit
        index, fn, current = entry
        if index in (1, 2) and state is not None and state.cached:
            if layout == "stack":
                if split_keys.ran_at_update(state, current) or entry in manager.qkv_edits:
                    continue  # ran at its cache's update, now or when the cache was filled (and edited)
            elif state.updated:
                state.check(module, qkv[1], qkv[2], "kv"[index - 1])
                continue  # ran on this call's new keys/values at the cache update
            elif not current and entry in manager.qkv_edits:
                continue  # cross-attention reading the cache it filled (and edited) in an earlier step
        if index == 3:
            pattern = eager_pattern(module, qkv[0], qkv[1], args, kwargs, implementation)  # (B, H, T, S)
            if own is not None:
                pattern = split_keys.part_of(pattern, own, current, layout)
            fn(pattern.transpose(1, 2))  # (B, T, H, S): one row per query token; read only
            continue
        x = qkv[index]  # (B, H, S, d); with a KV cache, S = cached + current tokens
        if own is not None and index:
            lo, hi = split_keys.rows(own, length, x.shape[2], current)
        else:
            lo, hi = (x.shape[2] - length if current and index else 0), x.shape[2]
        new = fn(x[:, :, lo:hi].transpose(1, 2))  # (B, T, H, d), the layout of the q/k/v sites
        if new is not None:
            qkv[index] = _replace(x, new.transpose(1, 2), lo, hi, index, qkv[1] is qkv[2])
    return qkv


def _kv_at_update(manager: HookManager, module: nn.Module) -> Callable:
    """The k/v hooks of `module`, run on the keys/values a cache `update` is about to store (of a
    module that attends to two stacks' keys, the hooks of the part that cache holds)."""
    def run(key: Tensor, value: Tensor, cache_class: str, part: str = "",
            edits: bool | None = None) -> tuple[Tensor, Tensor]:
        """`edits`: True runs only the edits, False only the reads, None both (edits first)."""
        both = manager.key_layouts.get(module, "") != "stack"
        kv = {1: key, 2: value}  # indexed as the q/k/v hooks' index
        for index in (1, 2):
            shape = manager.kv_shapes.get(module, {}).get(index)
            if shape is not None and kv[index].ndim == 4 and (kv[index].shape[1], kv[index].shape[3]) != shape:
                raise kv_cache.changed(module, cache_class, "kv"[index - 1])
        for index, fn, _ in [h for h in manager.qkv.get(module, ()) if h[0] in (1, 2) and
                             (both or h[2] == (part != "cross")) and
                             (edits is None or (h in manager.qkv_edits) == edits)]:  # edits first
            new = fn(kv[index].transpose(1, 2))  # (B, T, H, d): exactly this call's tokens
            if new is not None:
                kv[index] = new.transpose(1, 2).to(kv[index].dtype)
        return kv[1], kv[2]

    return run


def _replace(x: Tensor, new: Tensor, lo: int, hi: int, index: int, shared: bool = False) -> Tensor:
    """Put the edited rows [lo, hi) back. Keys and values are written in place (a module that
    attends over a dynamic cache it did not update through `update` then still keeps the edit),
    unless the key and value are one tensor (DeepSeek V4): an edit of one must leave the other."""
    if index in (1, 2) and not torch.is_grad_enabled() and not shared:
        x[:, :, lo:hi] = new
        return x
    if lo == 0 and hi == x.shape[2]:
        return new
    return torch.cat([x[:, :, :lo], new, x[:, :, hi:]], dim=2)


def implementation_of(module: nn.Module) -> str:
    config = getattr(module, "config", None)
    name = getattr(config, "_attn_implementation", None) or "eager"
    return name


def add_qkv_hook(manager: HookManager, module: nn.Module, which: str, fn: QKVHook, *, current: bool = True,
                 implementation: str | None = None, edit: bool = False,
                 shape: tuple[int, int] | None = None, key_layout: str = "") -> Handle:
    """Run `fn` on `which` ("q", "k" or "v") each time `module` calls its attention function.

    With `current=True` (self-attention) `fn` sees only the keys/values of this forward's
    tokens, not those read back from a KV cache (the cache is assumed to append at the end,
    as dynamic caches do). Cross-attention passes `current=False`: its keys are the encoder's.
    `shape` (heads, head dim) of a k/v site: a cache update of another shape (a latent the
    module expands afterwards) is refused instead of handed to `fn`. `key_layout` ("stack" or
    "appended", hooks/split_keys.py): the module attends to its tokens' keys followed by others;
    `current` then says which part a k/v/pattern hook is for.
    """
    if which not in _INDEX:
        raise ValueError(f"which must be one of 'q', 'k', 'v', 'pattern'; got {which!r}")
    _install(manager, implementation or implementation_of(module))
    entry = (_INDEX[which], fn, current)
    hooks = manager.qkv.setdefault(module, [])
    if key_layout:
        manager.key_layouts[module] = key_layout
    key_layout = manager.key_layouts.get(module, "")  # or as declared by set_key_layout
    if (which in ("k", "v") or key_layout == "stack") and module not in manager.kv_watchers:  # "stack": splits at the cache
        manager.kv_watchers[module] = kv_cache.watch(manager, module, _kv_at_update(manager, module))
    if which in ("k", "v") and shape is not None:
        manager.kv_shapes.setdefault(module, {})[_INDEX[which]] = shape
    if edit:  # edits before reads; among edits, registration order
        hooks.insert(sum(1 for h in hooks if h in manager.qkv_edits), entry)
        manager.qkv_edits.add(entry)
    else:
        hooks.append(entry)

    def remove() -> None:
        hooks = manager.qkv.get(module, [])
        if entry in hooks:
            hooks.remove(entry)
        manager.qkv_edits.discard(entry)
        watched = any(h[0] in (1, 2) for h in hooks) or (hooks and manager.key_layouts.get(module) == "stack")
        if module in manager.kv_watchers and not watched:
            manager.kv_watchers.pop(module).remove()
            manager.kv_shapes.pop(module, None)
        if not hooks:
            manager.qkv.pop(module, None)
            manager.key_layouts.pop(module, None)
        if not manager.qkv and not manager.observers:
            _uninstall_all(manager)

    return Handle(remove)


def set_key_layout(manager: HookManager, module: nn.Module, kind: str) -> Handle:
    """Declare, before adding its hooks, that `module`'s calls attend to their tokens' keys followed
    by others ("stack" or "appended", as `add_qkv_hook`'s `key_layout`); the declaration goes with
    the module's last q/k/v hook, or with this handle where none was added."""
    manager.key_layouts[module] = kind

    def remove() -> None:
        if not manager.qkv.get(module):
            manager.key_layouts.pop(module, None)

    return Handle(remove)


def _install(manager: HookManager, name: str) -> None:
    if name not in manager.attention_entries:
        manager.attention_entries[name] = manager.attention_entry(
            name, lambda previous: _wrap(manager, name, previous))


def observe_calls(manager: HookManager, implementations: set[str], fn: Callable) -> Handle:
    """Call `fn(module, query, key, value, kwargs)` on every attention-function call of the
    given implementations by a module of the manager's model (used once at attach to find
    which modules call it)."""
    own = WeakSet(manager.model.modules())

    def observe(module: nn.Module, *args) -> None:
        if module in own:
            fn(module, *args)

    for name in implementations:
        _install(manager, name)
    manager.observers.append(observe)

    def remove() -> None:
        if observe in manager.observers:
            manager.observers.remove(observe)
        if not manager.qkv and not manager.observers:
            _uninstall_all(manager)

    return Handle(remove)


def _uninstall_all(manager: HookManager) -> None:
    while manager.attention_entries:
        manager.attention_entries.popitem()[1].remove()


def active_hook_count(manager: HookManager) -> int:
    """Number of q/k/v hooks currently registered on the manager's model (0 when nothing is attached)."""
    return sum(len(v) for v in manager.qkv.values())
