"""Hooks on q/k/v as the attention function receives them (after rotary embedding).

Post-rotary q and k are outputs of no module. Attention modules in transformers v5 look
up their kernel in `ALL_ATTENTION_FUNCTIONS` by `config._attn_implementation` at every
call, so while at least one q/k/v hook exists we register, under that name, a wrapper that
runs the hooks of the calling module and then the original kernel. Modules without hooks
pass straight through; when the last hook goes, the registry is restored exactly.

    handle = add_qkv_hook(model.model.layers[3].self_attn, "k", fn)   # fn((B, T, H, d)) -> None | tensor
    handle.remove()
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
from torch import Tensor, nn

from conceptlens.hooks import kv_cache, split_keys
from conceptlens.hooks.handles import Handle
from conceptlens.hooks.pattern import eager_pattern

QKVHook = Callable[[Tensor], Tensor | None]
_INDEX = {"q": 0, "k": 1, "v": 2, "pattern": 3}
_MISSING = object()

_hooks: dict[nn.Module, list[tuple[int, QKVHook, bool]]] = {}
_installed: dict[str, object] = {}  # implementation name -> previous local entry (or _MISSING)
_edits: set = set()  # entries registered by steering (run before reads)
_observers: list[Callable] = []  # fn(module, query, key, value, kwargs) for every call (attach-time probe)
_watchers: dict[nn.Module, Handle] = {}  # modules with k/v hooks: their cache updates run the hooks
_kv_shape: dict[tuple[nn.Module, int], tuple[int, int]] = {}  # (module, 1 | 2) -> the site's (heads, head dim)


def _registry():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS


def _eager_of(module: nn.Module) -> Callable:
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(f"{type(module).__name__} uses eager attention but its module defines no "
                           "eager_attention_forward; its q/k/v cannot be hooked")
    return fn


def _wrap(name: str, previous: object) -> Callable:
    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, *args, **kwargs):
        for observe in list(_observers):
            observe(module, query, key, value, kwargs)
        hooks = _hooks.get(module)
        if hooks:
            query, key, value = _run_hooks(hooks, [query, key, value], args, kwargs, module)
        if previous is _MISSING:
            original = _registry()._global_mapping.get(name) or _eager_of(module)
        else:
            original = previous
        return original(module, query, key, value, *args, **kwargs)

    attention.__conceptlens_wrapper__ = True
    return attention


def _run_hooks(hooks: list, qkv: list[Tensor], args: tuple, kwargs: dict, module: nn.Module) -> list[Tensor]:
    length = qkv[0].shape[2]
    state = kv_cache.call_state(module)
    layout = split_keys.layout_of(module)
    own = split_keys.own_length(module, length, state)  # None: the keys end with this call's tokens
    for entry in sorted(hooks, key=lambda h: h[0] == 3):  # patterns after every q/k edit
        index, fn, current = entry
        if index in (1, 2) and state is not None and state.cached:
            if layout == "stack":
                if split_keys.ran_at_update(state, current) or entry in _edits:
                    continue  # ran at its cache's update, now or when the cache was filled (and edited)
            elif state.updated:
                state.check(module, qkv[1], qkv[2], "kv"[index - 1])
                continue  # ran on this call's new keys/values at the cache update
            elif not current and entry in _edits:
                continue  # cross-attention reading the cache it filled (and edited) in an earlier step
        if index == 3:
            pattern = eager_pattern(module, qkv[0], qkv[1], args, kwargs)  # (B, H, T, S)
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


def _kv_at_update(module: nn.Module) -> Callable:
    """The k/v hooks of `module`, run on the keys/values a cache `update` is about to store (of a
    module that attends to two stacks' keys, the hooks of the part that cache holds)."""
    def run(key: Tensor, value: Tensor, cache_class: str, part: str = "") -> tuple[Tensor, Tensor]:
        both = split_keys.layout_of(module) != "stack"
        kv = [None, key, value]
        for index in (1, 2):
            shape = _kv_shape.get((module, index))
            if shape is not None and kv[index].ndim == 4 and (kv[index].shape[1], kv[index].shape[3]) != shape:
                raise kv_cache.changed(module, cache_class, "kv"[index - 1])
        for index, fn, _ in [h for h in _hooks.get(module, ()) if h[0] in (1, 2) and
                             (both or h[2] == (part != "cross"))]:  # edits first
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


def add_qkv_hook(module: nn.Module, which: str, fn: QKVHook, *, current: bool = True,
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
    _install(implementation or implementation_of(module))
    entry = (_INDEX[which], fn, current)
    hooks = _hooks.setdefault(module, [])
    split_keys.register(module, key_layout)
    if (which in ("k", "v") or key_layout == "stack") and module not in _watchers:  # "stack": splits at the cache
        _watchers[module] = kv_cache.watch(module, _kv_at_update(module))
    if which in ("k", "v") and shape is not None:
        _kv_shape[(module, _INDEX[which])] = shape
    if edit:  # edits before reads; among edits, registration order
        hooks.insert(sum(1 for h in hooks if h in _edits), entry)
        _edits.add(entry)
    else:
        hooks.append(entry)

    def remove() -> None:
        hooks = _hooks.get(module, [])
        if entry in hooks:
            hooks.remove(entry)
        _edits.discard(entry)
        watched = any(h[0] in (1, 2) for h in hooks) or (hooks and split_keys.layout_of(module) == "stack")
        if module in _watchers and not watched:
            _watchers.pop(module).remove()
            _kv_shape.pop((module, 1), None)
            _kv_shape.pop((module, 2), None)
        if not hooks:
            _hooks.pop(module, None)
            split_keys.forget(module)
        if not _hooks and not _observers:
            _uninstall_all()

    return Handle(remove)


def _install(name: str) -> None:
    registry = _registry()
    if name not in _installed:
        _installed[name] = registry._local_mapping.get(name, _MISSING)
        registry._local_mapping[name] = _wrap(name, _installed[name])


def observe_calls(implementations: set[str], fn: Callable) -> Handle:
    """Call `fn(module, query, key, value, kwargs)` on every attention-function call of the
    given implementations (used once at attach to find which modules call it)."""
    for name in implementations:
        _install(name)
    _observers.append(fn)

    def remove() -> None:
        if fn in _observers:
            _observers.remove(fn)
        if not _hooks and not _observers:
            _uninstall_all()

    return Handle(remove)


def _uninstall_all() -> None:
    registry = _registry()
    for name, previous in list(_installed.items()):
        if previous is _MISSING:
            registry._local_mapping.pop(name, None)
        else:
            registry._local_mapping[name] = previous
        del _installed[name]


def active_hook_count() -> int:
    """Number of q/k/v hooks currently registered (0 when nothing is attached)."""
    return sum(len(v) for v in _hooks.values())

