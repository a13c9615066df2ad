"""The hook manager of one model: everything conceptlens puts on it, and how to take it off.

    hooks = HookManager(model)                 # the Lens makes one per model
    handle = hooks.forward_hook(block, fn)     # also pre_hook, to_front, patch, attention_entry
    hooks.attached()                           # [Attached("forward_hook", "model.layers.0", ...), ...]
    hooks.close()                              # the model is as it was before

It is the only code that registers torch hooks, reorders a module's hooks or patches an
attribute (`module.forward`, `cache.update`, transformers' attention registry). It owns the
tables the hooks modules keep per module (held weakly), the steering scope stack and the
site-norm cache, so two models (or two threads with a lens each) share nothing.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, NamedTuple
from weakref import WeakKeyDictionary

from torch import nn

from conceptlens.hooks.handles import Handle
from conceptlens.hooks.scopes import ScopeStack

_MISSING = object()
_REGISTRY_LOCK = threading.Lock()  # transformers' attention registry is one per process; entries chain under it


class Attached(NamedTuple):
    """One thing a manager put on its model."""

    kind: str
    """"forward_hook", "forward_pre_hook", "patch" or "attention_registry"."""
    target: str
    """The module's path in the model (or the patched object's class, or the registry name)."""
    detail: str
    """The hook's id, or the patched attribute."""


class HookHandle(Handle):
    """A handle on one torch hook; `id` is torch's key in the module's hook dict."""

    def __init__(self, remove_fn: Callable[[], Any], id: int) -> None:
        super().__init__(remove_fn)
        self.id = id


class HookManager:
    """Every hook, patch and per-module table of conceptlens on one model; see the module docstring."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self._live: dict[int, tuple[str, weakref.ref | None, str, Handle]] = {}
        """Key -> (kind, weak target, detail, handle) of each thing attached now, in attach order."""
        self._next = 0
        self.closed = False
        # Tables of the hooks modules, per module (weakly); each empties when its last hook goes.
        self.qkv: WeakKeyDictionary[nn.Module, list] = WeakKeyDictionary()
        """Attention module -> its q/k/v/pattern hook entries (hooks/attention.py)."""
        self.qkv_edits: set = set()
        """Entries of `qkv` registered by steering (they run before reads)."""
        self.observers: list[Callable] = []
        """Called on every attention-function call of the model (the attach-time probe)."""
        self.attention_entries: dict[str, Handle] = {}
        """Implementation name -> this manager's entry in transformers' attention registry."""
        self.kv_watchers: WeakKeyDictionary[nn.Module, Handle] = WeakKeyDictionary()
        """Attention module with k/v hooks -> the watch routing its cache updates through them."""
        self.kv_shapes: WeakKeyDictionary[nn.Module, dict[int, tuple[int, int]]] = WeakKeyDictionary()
        """Attention module -> {1 (k) | 2 (v): the site's (heads, head dim)}."""
        self.kv_calls: WeakKeyDictionary[nn.Module, Any] = WeakKeyDictionary()
        """Watched module -> the running call's CallState (hooks/kv_cache.py)."""
        self.key_layouts: WeakKeyDictionary[nn.Module, str] = WeakKeyDictionary()
        """Module attending to its own keys followed by others -> "stack" / "appended"."""
        self.counters: WeakKeyDictionary[nn.Module, Any] = WeakKeyDictionary()
        """Layer a stack runs several times -> its call counter (hooks/calls.py)."""
        self.routes: WeakKeyDictionary[nn.Module, Any] = WeakKeyDictionary()
        """Block its stack calls through `forward` -> its route (hooks/routed.py)."""
        self.streams: WeakKeyDictionary[nn.Module, dict[tuple[int, int], Any]] = WeakKeyDictionary()
        """Sublayer spread over residual streams -> {(gate, receiver) ids: its writes} (hooks/hyper.py)."""
        self.site_norms: dict[str, Any] = {}
        """Site name -> its SiteScale over the probe text (steering/units.py), measured once."""
        self.steering = ScopeStack(self)
        """The open steering scopes, in entry order, and one edit hook per edited site."""
        self.reader: Any = None
        """Inside `private_forward`: the one capture that reads the model's forwards (others ignore them)."""
        self.peers: Callable[[], list[HookManager]] = lambda: [self]
        """The managers of every lens attached to the model, this one included (`Lens` sets it)."""

    @property
    def model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this hook manager no longer exists")
        return model

    # -- the only registrations ---------------------------------------------------------------
    def forward_hook(self, module: nn.Module, fn: Callable, *, prepend: bool = False, with_kwargs: bool = False,
                     always_call: bool = False) -> HookHandle:
        """`module.register_forward_hook(...)`, recorded; the handle removes it."""
        self._check_open()
        torch_handle = module.register_forward_hook(fn, prepend=prepend, with_kwargs=with_kwargs,
                                                    always_call=always_call)
        return self._record("forward_hook", module, str(torch_handle.id), torch_handle.remove, torch_handle.id)

    def pre_hook(self, module: nn.Module, fn: Callable, *, prepend: bool = False,
                 with_kwargs: bool = False) -> HookHandle:
        """`module.register_forward_pre_hook(...)`, recorded; the handle removes it."""
        self._check_open()
        torch_handle = module.register_forward_pre_hook(fn, prepend=prepend, with_kwargs=with_kwargs)
        return self._record("forward_pre_hook", module, str(torch_handle.id), torch_handle.remove, torch_handle.id)

    def to_front(self, module: nn.Module, handle: HookHandle, *, pre: bool = False) -> None:
        """Move one of this manager's hooks in front of the module's other hooks of its kind."""
        hooks: OrderedDict = module._forward_pre_hooks if pre else module._forward_hooks  # type: ignore[assignment]
        if handle.id in hooks and not handle.removed:
            hooks.move_to_end(handle.id, last=False)

    def patch(self, target: object, name: str, value: object) -> Handle:
        """Set the instance attribute `target.name` (e.g. a module's `forward`, a cache's `update`);
        the handle restores exactly what the instance had (nothing, or its own attribute)."""
        self._check_open()
        saved = vars(target).get(name, _MISSING)
        setattr(target, name, value)
        ref = weakref.ref(target)

        def restore() -> None:
            obj = ref()
            if obj is None or vars(obj).get(name, _MISSING) is not value:
                return  # gone, or someone set it again since: theirs stays
            if saved is _MISSING:
                vars(obj).pop(name, None)
            else:
                setattr(obj, name, saved)

        return self._record("patch", target, name, restore)

    def attention_entry(self, name: str, make: Callable[[Callable[[], Callable | None]], Callable]) -> Handle:
        """Put `make(previous)` under `name` in transformers' attention registry, above what is
        there (`previous()` reads it at call time: the entry below, or None for the global one).
        Entries of several managers chain; removing one splices it out of the chain."""
        self._check_open()
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        mapping = ALL_ATTENTION_FUNCTIONS._local_mapping
        link: dict[str, Any] = {}
        fn = make(lambda: None if link["below"] is _MISSING else link["below"])
        setattr(fn, "__conceptlens_link__", link)  # how a later manager's entry finds this one below it
        with _REGISTRY_LOCK:
            link["below"] = mapping.get(name, _MISSING)
            mapping[name] = fn

        def remove() -> None:
            with _REGISTRY_LOCK:
                above = mapping.get(name, _MISSING)
                if above is fn:
                    if link["below"] is _MISSING:
                        mapping.pop(name, None)
                    else:
                        mapping[name] = link["below"]
                    return
                while (upper := getattr(above, "__conceptlens_link__", None)) is not None:
                    if upper["below"] is fn:
                        upper["below"] = link["below"]
                        return
                    above = upper["below"]

        return self._record("attention_registry", None, name, remove)

    @contextmanager
    def private_forward(self, capture: Any) -> Iterator[None]:
        """Forwards of the library's own inside the block (the steering unit's probe text), for every
        lens attached to the model: no steering scope's edit applies or observes, and no capture but
        `capture` reads them (a user's open capture, `on_batch` included, never sees the probe's rows).
        A function put on with `lens.hook` is the user's own hook and still runs."""
        with ExitStack() as stack:
            for manager in self.peers():
                stack.enter_context(manager.steering.suspended())
                stack.enter_context(manager._read_only_by(capture))
            yield

    @contextmanager
    def _read_only_by(self, capture: Any) -> Iterator[None]:
        before, self.reader = self.reader, capture
        try:
            yield
        finally:
            self.reader = before

    def reads(self, capture: Any) -> bool:
        """Whether `capture` reads the forward running now (see `private_forward`)."""
        return self.reader is None or self.reader is capture

    @contextmanager
    def dropping_new_hooks(self) -> Iterator[None]:
        """Hooks that others (transformers' output-capturing hooks on the first
        `output_hidden_states=True` forward) add to the model inside the `with` are removed after."""
        flag = "_output_capturing_hooks_installed"
        saved = [(m, set(m._forward_hooks), set(m._forward_pre_hooks), m.__dict__.get(flag, _MISSING))
                 for m in self.model.modules()]
        try:
            yield
        finally:
            for module, forward, pre, had in saved:
                for key in set(module._forward_hooks) - forward:
                    for table in (module._forward_hooks, module._forward_hooks_with_kwargs,
                                  module._forward_hooks_always_called):
                        table.pop(key, None)
                for key in set(module._forward_pre_hooks) - pre:
                    module._forward_pre_hooks.pop(key, None)
                    module._forward_pre_hooks_with_kwargs.pop(key, None)
                if had is _MISSING:
                    module.__dict__.pop(flag, None)
                else:
                    module.__dict__[flag] = had

    # -- what is attached ---------------------------------------------------------------------
    def attached(self) -> list[Attached]:
        """Everything this manager has on the model now, in the order it was put there."""
        model = self._model()
        names = {m: n for n, m in model.named_modules()} if model is not None else {}
        out = []
        for kind, ref, detail, _ in self._live.values():
            target = ref() if ref is not None else None
            if ref is None:
                where = "ALL_ATTENTION_FUNCTIONS"
            elif isinstance(target, nn.Module) and target in names:
                where = names[target] or "<model>"
            else:
                where = type(target).__name__
            out.append(Attached(kind, where, detail))
        return out

    def close(self) -> None:
        """Remove everything attached (last first) and forget every table; safe to call twice."""
        self.closed = True
        error: BaseException | None = None
        while self._live:
            key = next(reversed(self._live))
            try:
                self._live[key][3].remove()
            except BaseException as err:  # keep removing; report the first failure
                error = error or err
            self._live.pop(key, None)
        for table in (self.qkv, self.kv_watchers, self.kv_shapes, self.kv_calls, self.key_layouts,
                      self.counters, self.routes, self.streams):
            table.clear()
        self.qkv_edits.clear()
        self.observers.clear()
        self.attention_entries.clear()
        self.site_norms.clear()
        self.steering.forget()
        if error is not None:
            raise error

    def __enter__(self) -> HookManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this lens was closed; attach the model again to hook it")

    def _record(self, kind: str, target: object, detail: str, remove: Callable[[], Any],
                id: int | None = None) -> HookHandle:
        key, self._next = self._next, self._next + 1

        def release() -> None:
            self._live.pop(key, None)
            remove()

        handle = HookHandle(release, -1 if id is None else id)
        self._live[key] = (kind, None if target is None else weakref.ref(target), detail, handle)
        return handle
