"""Handles: every hook conceptlens registers is removed through one of these.

    with Handle(remove_fn):          # or handle.remove(); safe to call twice
        ...
    group = HandleGroup()            # collects handles; removes all, last first
    group.add(hooks.forward_hook(module, fn))   # hooks: the model's HookManager
    group.remove()
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, TypeVar


class Removable(Protocol):
    def remove(self) -> None: ...


R = TypeVar("R", bound=Removable)


class Handle:
    """Calls `remove_fn` once, however often `remove()` is called."""

    def __init__(self, remove_fn: Callable[[], Any]) -> None:
        self._remove_fn: Callable[[], Any] | None = remove_fn

    @property
    def removed(self) -> bool:
        return self._remove_fn is None

    def remove(self) -> None:
        fn, self._remove_fn = self._remove_fn, None
        if fn is not None:
            fn()

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class HandleGroup(Handle):
    """Several handles removed together, in reverse order of registration.

    Every removal is attempted even if one raises; the first error is raised afterwards.
    """

    def __init__(self) -> None:
        self._handles: list[Removable] = []
        super().__init__(self._remove_all)

    def add(self, handle: R) -> R:
        if self.removed:
            handle.remove()
            raise RuntimeError("this HandleGroup was already removed; the new hook was not kept")
        self._handles.append(handle)
        return handle

    def clear(self) -> None:
        """Remove the handles added so far; unlike `remove()`, the group takes more afterwards."""
        self._remove_all()

    def __len__(self) -> int:
        return len(self._handles)

    def _remove_all(self) -> None:
        error: BaseException | None = None
        while self._handles:
            try:
                self._handles.pop().remove()
            except BaseException as err:  # keep removing; report the first failure
                error = error or err
        if error is not None:
            raise error
