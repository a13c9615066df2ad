"""k/v hooks at the KV cache: edits reach the cache whatever its class.

An attention module stores its new keys and values with `cache.update(key, value, layer, ...)`
and attends over what the cache returns: for a dynamic cache, its storage with the new
tokens at the end; for a static cache, the whole preallocated buffer; for a quantised cache,
a dequantised copy. Editing what the attention function receives therefore reaches the cache
only in the first case (and only outside autograd). So while a module has k/v hooks, each of
its calls that carries a cache routes that cache's `update` through the hooks: they see
exactly this call's new keys/values (before storage), and the cache stores the edited ones.

    handle = watch(hooks, attention_module, run_kv)   # run_kv(key, value, cache_class, part, edits) -> (key, value), (B, H, T, d)
    state = hooks.kv_calls.get(attention_module)      # during the call: did it carry a cache / update it?
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from torch import Tensor, nn

from conceptlens.hooks.handles import Handle, HandleGroup

if TYPE_CHECKING:
    from conceptlens.hooks.manager import HookManager


class CallState:
    """One call of a watched module: did it carry a cache, did it call `update`, and what did
    the update return (the module must attend to exactly those tensors)."""

    __slots__ = ("cached", "updated", "returned", "cache_class", "parts")

    def __init__(self, cached: bool) -> None:
        self.cached = cached
        self.updated = False
        self.returned: tuple = ()
        self.cache_class = ""
        self.parts: dict[str, tuple] = {}
        """"self" / "cross" -> what that cache of an encoder-decoder cache returned in this call."""

    def check(self, module: nn.Module, key: Tensor, value: Tensor, which: str) -> None:
        """ValueError unless the attention function got the keys/values the cache returned: a
        module that changes them in between (splits, repeats) attends to k/v the hooks never saw."""
        if self.returned and (key is not self.returned[0] or value is not self.returned[1]):
            raise changed(module, self.cache_class, which)


def changed(module: nn.Module, cache_class: str, which: str) -> ValueError:
    return ValueError(f"{type(module).__name__} attends to other keys/values than it stores in its {cache_class} "
                      f"(e.g. a latent it expands), so attn.{which} hooks cannot follow the cache; run with "
                      "use_cache=False, or use the attn.q, attn_out or resid sites")


def _caches(args: tuple, kwargs: dict) -> list:
    from transformers.cache_utils import Cache, EncoderDecoderCache

    found: list[tuple[Cache, str]] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, EncoderDecoderCache):  # the module updates one of its two caches (or both)
            found += [(value.self_attention_cache, "self"), (value.cross_attention_cache, "cross")]
        elif isinstance(value, Cache):
            found.append((value, ""))
    return found


def watch(manager: HookManager, module: nn.Module,
          run_kv: Callable[[Tensor, Tensor, str, str], tuple[Tensor, Tensor]]) -> Handle:
    """While `module` runs with a cache among its arguments, that cache's `update` first
    passes the new keys and values through `run_kv` (with "self" / "cross" for the two caches
    of an encoder-decoder cache, "" otherwise); restored when the call ends. The running
    call's CallState is `manager.kv_calls[module]`."""
    patched = HandleGroup()  # this call's patches of `cache.update`

    def pre(mod, args, kwargs):
        patched.clear()
        caches = _caches(args, kwargs)
        state = manager.kv_calls[mod] = CallState(bool(caches))
        for cache, part in caches:
            patched.add(manager.patch(cache, "update", _routed(cache.update, run_kv, state,
                                                              type(cache).__name__, part)))

    def post(mod, args, kwargs, output):
        patched.clear()
        manager.kv_calls.pop(mod, None)

    group = HandleGroup()
    try:
        group.add(manager.pre_hook(module, pre, with_kwargs=True))
        # in front: with two managers on one module, the later one's patch is undone first
        group.add(manager.forward_hook(module, post, with_kwargs=True, always_call=True, prepend=True))
    except BaseException:
        group.remove()
        raise
    def forget() -> None:
        patched.clear()
        manager.kv_calls.pop(module, None)

    group.add(Handle(forget))
    return group


def _routed(original: Callable, run_kv: Callable, state: CallState, cache_class: str, part: str) -> Callable:
    """`update` through `run_kv`. Patched by several lenses of one model, the outer (later) patch runs
    every lens's edits, then every lens's reads, inner (earlier) lenses first, then the cache's own
    `update`; each lens's call state records the update."""
    def update(key_states: Tensor, value_states: Tensor, *args, **kwargs):
        chain, fn = [], update
        while (route := getattr(fn, "__conceptlens_kv__", None)) is not None:
            chain.append(route)
            fn = route[0]
        for edits in (True, False):
            for _, run, _, cls, where in reversed(chain):
                key_states, value_states = run(key_states, value_states, cls, where, edits)
        out = fn(key_states, value_states, *args, **kwargs)
        returned = tuple(out) if isinstance(out, (tuple, list)) and len(out) == 2 else ()
        for _, _, call, cls, where in chain:
            call.updated, call.cache_class, call.returned = True, cls, returned
            if where:
                call.parts[where] = returned
        return out

    setattr(update, "__conceptlens_kv__", (original, run_kv, state, cache_class, part))
    return update
