"""Argument checks shared by the public API: unknown keyword arguments name the valid ones.

    @known_kwargs
    def fit(self, extractors, data, *, batch_size=16): ...
    lens.fit(ex, data, batchsize=8)   # TypeError: ... unknown keyword argument 'batchsize'
                                      #   (did you mean 'batch_size'?); valid: batch_size, ...
"""

from __future__ import annotations

import difflib
import functools
import inspect
import os
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def known_kwargs(fn: F) -> F:
    """Wrap `fn` so an unknown keyword argument raises a TypeError listing the valid names."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn
    valid = [name for name, p in params.items() if name != "self" and p.kind in
             (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    what = fn.__qualname__.replace(".__init__", "")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        unknown = [k for k in kwargs if k not in valid]
        if unknown:
            raise TypeError(unknown_message(what, unknown, valid))
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def unknown_message(what: str, unknown: list[str], valid: list[str]) -> str:
    close = difflib.get_close_matches(unknown[0], valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    names = ", ".join(map(repr, unknown))
    return (f"{what}() got unknown keyword argument{'s' if len(unknown) > 1 else ''} {names}{hint}; "
            f"valid: {', '.join(valid)}")


def available_memory() -> int | None:
    """Bytes of memory the system can still give (MemAvailable), or None where it cannot say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(what: str, n_bytes: int) -> None:
    """A one-line ValueError before allocating `n_bytes` for `what` when the system has less free."""
    free = available_memory()
    if free is not None and n_bytes > free:
        raise ValueError(f"{what} needs {n_bytes / 2**30:.3g} GiB of memory; {free / 2**30:.3g} GiB is available")
