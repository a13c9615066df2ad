"""Argument checks shared by the public API: unknown keyword arguments name the valid ones, and
the validators of options and config fields (`check_int`, `check_float`, `check_fraction`,
`check_bool`, `check_choice`): one-line errors that name the bad value.

    @known_kwargs
    def fit(self, extractors, data, *, batch_size=16): ...
    lens.fit(ex, data, batchsize=8)   # TypeError: ... unknown keyword argument 'batchsize'
                                      #   (did you mean 'batch_size'?); valid: batch_size, ...
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import os
from collections.abc import Iterable
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


# ---- validation helpers: one-line errors that name the bad value -------------------------

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


MAX_INT64 = 2**63 - 1
"""Largest int any option may hold: torch reads seeds, counts and sizes as int64."""
def check_int(name: str, value: Any, low: int = 1, *, high: int = MAX_INT64, optional: bool = False) -> None:
    """Raise unless `value` is an int (not a bool) in [`low`, `high`] (or None when `optional`)."""
    if optional and value is None:
        return
    if not _is_int(value) or value < low:
        extra = " or None" if optional else ""
        what = "a positive integer" if low == 1 else f"an int >= {low}"
        raise ValueError(f"{name} must be {what}{extra}; got {value!r}")
    if value > high:
        raise ValueError(f"{name} must be at most {high}{' (int64)' if high == MAX_INT64 else ''}; got {value}")


def check_float(name: str, value: Any, low: float = 0.0, *, strict: bool = False, optional: bool = False) -> None:
    """Raise unless `value` is a finite real > `low` (strict) or >= `low` (or None when `optional`)."""
    if optional and value is None:
        return
    if not _is_real(value) or (value <= low if strict else value < low):
        extra = " or None" if optional else ""
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {low}{extra}; got {value!r}")


def check_fraction(name: str, value: Any, *, closed_high: bool = False) -> None:
    """Raise unless `value` is a real in [0, 1) (or [0, 1] with `closed_high`)."""
    ok = _is_real(value) and 0 <= value and (value <= 1 if closed_high else value < 1)
    if not ok:
        raise ValueError(f"{name} must be a number in [0, 1{']' if closed_high else ')'}; got {value!r}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False; got {value!r}")


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}; got {value!r}")


def usable_devices() -> list[str]:
    """The devices tensors can live on here: cpu, cuda and each cuda:N with CUDA, mps with Metal."""
    import torch

    valid = ["cpu"] + (["cuda", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
                       if torch.cuda.is_available() else [])
    return valid + (["mps"] if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
                    else [])


def check_device(name: str, device: Any) -> Any:
    """`device` as a torch.device when tensors can live on it here; else a one-line ValueError naming
    it and the valid choices (meta holds no values: nothing can be fitted on it)."""
    import torch

    try:
        kind = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        kind = None
    valid = usable_devices()
    if kind is None or str(kind) not in valid:
        raise ValueError(f"{name} {device!r} is not available here; valid: {', '.join(valid)}")
    return kind
