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
