"""Checks of loaded files and states by their content, not their declarations: every reader
of a checkpoint, ConceptSet, SAELens folder, JSON or TOML file calls these, and each error
is one line naming the file and the field.

    cfg = read_json(path)                                  # nesting depth checked, no RecursionError
    field(path, "d_sae", cfg.get("d_sae"), int, low=1)     # a JSON type and an integer range
    check_tensor(path, "W_dec", w, shape=(d_sae, d_in))    # a shape, and finite values
    check_no_nan(path, "extractors/km", state)             # every float tensor of a nested state
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

MAX_DEPTH = 64
"""Deepest nesting of lists and dicts any of our files has (a checkpoint holds ~6 levels)."""
MAX_COUNT = 2**31 - 1
"""Largest count (concepts, width, k) a file may declare: past it no tensor could be allocated."""


def field(where: Any, name: str, value: Any, kind: type | tuple[type, ...], *,
          low: float | None = None, high: float | None = None, optional: bool = False) -> Any:
    """`value` if it is of `kind` (a bool is no int or float) within [low, high]; else ValueError
    "`where`: `name` must be ...; got ..."."""
    if optional and value is None:
        return value
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if ok and isinstance(value, float) and not math.isfinite(value):
        ok = False
    if ok and low is not None and value < low or ok and high is not None and value > high:
        ok = False
    if not ok:
        names = " or ".join(_kind_name(k) for k in kinds) + (" or null" if optional else "")
        bounds = (f" in [{low:g}, {high:g}]" if low is not None and high is not None else
                  f" >= {low:g}" if low is not None else f" <= {high:g}" if high is not None else "")
        raise ValueError(f"{where}: {name} must be {names}{bounds}; got {_short(value)}")
    return value


def check_tensor(where: Any, name: str, t: Any, *, shape: tuple[int, ...] | None = None,
                 finite: bool = True) -> Tensor:
    """`t` if it is a tensor of `shape` (when given) whose floating values are all finite."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{where}: {name} must be a tensor; got {type(t).__name__}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{where}: {name} has shape {tuple(t.shape)}; expected {tuple(shape)}")
    if finite and t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{where}: {name} holds {bad} NaN or infinite value{'s' if bad > 1 else ''} "
                         f"(of {t.numel()}); the file is corrupt or was written by a diverged fit")
    return t


def check_no_nan(where: Any, name: str, state: Any) -> None:
    """No floating tensor in a nested state (dicts, lists, tuples) holds NaN. Infinities are
    allowed here (a top-n keeps its empty slots at -inf); concepts are checked fully finite
    by `check_extractor`."""
    stack = [(name, state)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, Tensor) and value.is_floating_point() and bool(value.isnan().any()):
            raise ValueError(f"{where}: {path} holds {int(value.isnan().sum())} NaN value(s) (of {value.numel()}); "
                             "the file is corrupt or was written by a diverged fit")
        elif isinstance(value, dict):
            stack.extend((f"{path}/{k}", v) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{path}/{i}", v) for i, v in enumerate(value))


def check_depth(where: Any, value: Any, limit: int = MAX_DEPTH) -> Any:
    """`value` unless its lists and dicts nest deeper than `limit` (checked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list, tuple)):
            if depth > limit:
                raise ValueError(f"{where}: nested deeper than {limit} levels; not a file this library writes")
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return value


def parse_json(text: str | bytes, where: Any) -> Any:
    """JSON from `text`, depth-checked; a one-line ValueError naming `where` otherwise."""
    try:
        return check_depth(where, json.loads(text))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{where} is not valid JSON: {err}") from None
    except RecursionError:
        raise ValueError(f"{where}: nested deeper than {MAX_DEPTH} levels; not a file this library writes") from None


def read_json(path: str | os.PathLike[str]) -> Any:
    """The JSON in the file `path`, depth-checked (see `parse_json`)."""
    return parse_json(Path(path).read_bytes(), path)


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The TOML in the file `path`, depth-checked; a one-line ValueError naming it otherwise."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        return check_depth(path, tomllib.loads(Path(path).read_text(encoding="utf-8")))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid TOML: {_short(err, 200)}") from None
    except RecursionError:
        raise ValueError(f"{path}: nested deeper than {MAX_DEPTH} levels; not a file this library writes") from None


def check_extractor(where: Any, name: str, extractor: Any, width: int | None) -> None:
    """A loaded extractor by what it computes: when fitted, its concepts are `(n, width)` and
    finite (the state's own `d` is a declaration; this reads the tensors)."""
    if not callable(getattr(extractor, "concept_set", None)):  # (a describer's state: its tensors were checked)
        return
    try:
        cs = extractor.concept_set()
    except (ValueError, RuntimeError):  # not fitted yet (NotFittedError): its raw tensors were checked
        return
    got = int(cs.directions.shape[-1])
    if width is not None and got != width:
        raise ValueError(f"{where}: the state of {name} holds concepts of width {got}; the site has width {width}")
    check_concept_tensors(where, f"the state of {name}", cs.directions, cs.encoder, cs.mean)


def check_concept_tensors(where: Any, what: str, directions: Tensor, encoder: dict[str, Tensor],
                          mean: Tensor | None) -> None:
    """Directions, encoder weights and mean of a concept set are finite."""
    check_tensor(where, f"{what}: directions", directions)
    for key, value in encoder.items():
        check_tensor(where, f"{what}: encoder.{key}", value)
    if mean is not None:
        check_tensor(where, f"{what}: mean", mean)


def _kind_name(kind: type) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "an object",
            list: "a list", type(None): "null"}.get(kind, kind.__name__)


def _short(value: Any, limit: int = 60) -> str:
    text = " ".join(repr(value).split()) if not isinstance(value, BaseException) else " ".join(str(value).split())
    return text if len(text) <= limit else text[:limit] + "..."
