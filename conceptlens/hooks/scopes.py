"""The steering scope stack of one model (owned by its HookManager).

Scopes are entered and left in any order; each site with edits has one hook that applies the
edits of every open scope there in entry order. Entering a scope registers hooks only at sites
no open scope edits yet (and the token tracker's pre-hooks when it is the first scope); leaving
one removes only the hooks of sites no other scope edits. A site shared with another scope keeps
its hook: only the function it calls is rebuilt.

    hooks.steering.enter(scope, stacks, [(site, edit), ...], build)   # build(site, entries, tracker) -> fn
    hooks.steering.leave(scope)
    with hooks.steering.suspended():   # a forward of the library's own (the steering unit's probe text):
        model(**probe)                 # no edit applies and no scope sees it as its prompt

A scope is any object with `observe(stack, tracker)`, called when a stack's forward starts.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

from torch import Tensor, nn

from conceptlens.hooks.handles import Handle, HandleGroup
from conceptlens.hooks.points import hook_site
from conceptlens.hooks.tokens import TokenTracker

if TYPE_CHECKING:
    from conceptlens.hooks.manager import HookManager

Build = Callable[[Any, list[tuple[Any, Any]], TokenTracker], Callable[[Tensor], Tensor | None]]
"""(site, [(scope, edit), ...] in entry order, tracker) -> the function the site's hook calls."""


class _SiteEdits:
    """One edited site: its entries, the function built from them, and its one hook."""

    def __init__(self, build: Build, stack: ScopeStack) -> None:
        self.build, self.stack = build, stack
        self.entries: list[tuple[Any, Any]] = []
        self.fn: Callable[[Tensor], Tensor | None] = lambda x: None
        self.handle: Handle | None = None

    def __call__(self, x: Tensor) -> Tensor | None:
        return None if self.stack.paused else self.fn(x)


class ScopeStack:
    """The open steering scopes, in entry order; see the module docstring."""

    def __init__(self, hooks: HookManager) -> None:
        self.hooks = hooks
        self.scopes: list[Any] = []
        self.tracker: TokenTracker | None = None
        self._tracker_handles = HandleGroup()
        self._sites: dict[Any, _SiteEdits] = {}  # Site (hashed by identity) -> its edits and hook
        self.paused = 0
        """How many `suspended()` blocks are open: while any is, no edit applies and no scope observes."""

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Run the block's forwards as if no scope were open (they stay open, their hooks in place)."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def enter(self, scope: Any, stacks: dict[str, nn.Module], edits: list[tuple[Any, Any]], build: Build) -> None:
        """Open `scope` with its `(site, edit)` pairs; on any error nothing of it stays."""
        self.scopes.append(scope)
        try:
            if self.tracker is None:
                self.tracker = TokenTracker(stacks, on_start=self._on_start)
                self.tracker.register(self.hooks, self._tracker_handles)
            for site in dict.fromkeys(site for site, _ in edits):
                slot = self._sites.get(site)
                if slot is None:
                    slot = self._sites[site] = _SiteEdits(build, self)
                slot.entries += [(scope, edit) for s, edit in edits if s is site]
                slot.fn = build(site, slot.entries, self.tracker)
                if slot.handle is None:
                    slot.handle = hook_site(self.hooks, site, slot, edit=True)
        except BaseException:
            self.leave(scope)
            raise

    def leave(self, scope: Any) -> None:
        """Close `scope`: its entries go; hooks of sites left without edits are removed."""
        if scope in self.scopes:
            self.scopes.remove(scope)
        for site, slot in list(self._sites.items()):
            kept = [(s, e) for s, e in slot.entries if s is not scope]
            if len(kept) == len(slot.entries) and slot.handle is not None:
                continue
            slot.entries = kept
            if not kept:
                del self._sites[site]
                if slot.handle is not None:
                    slot.handle.remove()
            elif self.tracker is not None:
                slot.fn = slot.build(site, kept, self.tracker)
        if not self.scopes:
            self.forget()

    def forget(self) -> None:
        """Drop every scope and remove every hook of the stack."""
        self.scopes.clear()
        sites, self._sites = self._sites, {}
        for slot in sites.values():
            if slot.handle is not None:
                slot.handle.remove()
        self._tracker_handles.clear()
        if self.tracker is not None:
            self.tracker.clear()
        self.tracker = None

    def _on_start(self, stack: str) -> None:
        if self.paused:
            return
        for scope in self.scopes:
            scope.observe(stack, self.tracker)
