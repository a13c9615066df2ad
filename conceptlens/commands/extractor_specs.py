"""Extractor specs of `conceptlens fit`: `--extractor 'topk:width=4608,k=32'` or an [[extractor]]
table, checked against the method registry before any model loads.

    parse_extractor("topk:width=4608,k=32,name=big")   # {"method": "topk", "width": 4608, ...}
    check_extractors([{"method": "topk", "k": 32}], ["blocks.3.resid_out"])   # named, keyed, checked
    budget_lr({"method": "topk", "width": 4608, "k": 32}, max_tokens=1_000_000)   # the lr for that budget
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from conceptlens._checks import check_int
from conceptlens._names import check_name
from conceptlens.concepts import registry
from conceptlens.fit_keys import Key, parse_key

METHODS = registry.names()
"""The methods `--extractor` fits: every registered one (the registry declares the rows each reads)."""
KEY_FORMS = {m.name: m.rows for m in registry.METHODS.values() if m.rows != "site"}
"""The methods that read several sites, and how their `site` is spelled (`fit_keys.FORMS`); the
others read one site."""


def method_class(method: str) -> type:
    found = registry.METHODS.get(registry.canonical(method))
    if found is None:
        raise ValueError(f"unknown extractor method {method!r}; choose one of {', '.join(METHODS)}")
    return found.load()


def hyper_parameters(cls: type) -> list[str]:
    """Keyword arguments a method accepts (its Config's fields for SAEs): its constructor's, and
    while a constructor passes **kwargs on, those of the classes it inherits from."""
    names: list[str] = []
    for init in (vars(k)["__init__"] for k in cls.__mro__ if "__init__" in vars(k)):
        params = inspect.signature(init).parameters
        names += [p for p, v in params.items() if p != "self" and p not in names
                  and v.kind not in (v.VAR_KEYWORD, v.VAR_POSITIONAL, v.POSITIONAL_ONLY)]
        if not any(v.kind == v.VAR_KEYWORD for v in params.values()):
            break
    config = getattr(cls, "Config", None)
    if config is not None and dataclasses.is_dataclass(config):
        names += [f.name for f in dataclasses.fields(config) if f.name not in names]
    return names


def parse_value(text: str) -> Any:
    """'32' -> 32, '1e-3' -> 0.001, 'true' -> True, 'none' -> None, 'a/b' -> (a, b), else the string."""
    if "/" in text:
        return tuple(parse_value(part) for part in text.split("/"))
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_extractor(spec: str) -> dict[str, Any]:
    """'topk:width=4608,k=32,name=big' -> {'method': 'topk', 'width': 4608, 'k': 32, 'name': 'big'}."""
    method, _, rest = spec.partition(":")
    out: dict[str, Any] = {"method": method.strip()}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"bad extractor option {item!r} in {spec!r}; write key=value, e.g. 'topk:width=4608,k=32'")
        out[key.strip()] = parse_value(value.strip())
    return out


BUDGET = "max_tokens"
"""An extractor entry's own budget (`FitConfig.extractor_tokens`): a fit option, not a hyper-parameter."""


def check_extractors(specs: list[dict[str, Any]], sites: list[str]) -> list[dict[str, Any]]:
    """The extractor entries, each with its method, a name unique in the run and its site (one
    entry per site of `sites` where a one-site method names none), its options checked."""
    if not specs:
        raise ValueError(f"no extractor given: pass --extractor 'topk:width=4608,k=32' (repeatable) or an "
                         f"[[extractor]] table; methods: {', '.join(METHODS)}")
    out: list[dict[str, Any]] = []
    names: dict[str, bool] = {}
    for spec in specs:
        spec = dict(spec)
        method = spec.pop("method", None)
        cls = method_class(str(method))
        method = registry.canonical(str(method))
        name, site = spec.pop("name", None), spec.pop("site", None)
        if not isinstance(name, (str, type(None))):  # 'name=a/b' parses as a tuple
            raise ValueError(f"extractor name {'/'.join(map(str, name)) if isinstance(name, tuple) else name!r} is "
                             "not a name: use letters, digits, '.', '_', '-'")
        valid = hyper_parameters(cls)
        for key in spec:
            if key not in valid and key != BUDGET:
                raise ValueError(f"{method} has no option {key!r}; valid: name, site, {BUDGET}, {', '.join(valid)}")
        if BUDGET in spec:
            check_int(f"extractor {name or method!r} {BUDGET}", spec[BUDGET])
        if method in KEY_FORMS:  # several sites: one entry, at the key its site spells
            parse_key(site, KEY_FORMS[method], f"extractor {name or method!r} ({method}) site")
            _claim(names, check_name(name or method, "extractor name"), method)
            out.append({"method": method, "name": name or method, "site": site, **spec})
            continue
        if isinstance(site, str) and ("->" in site or "+" in site):
            raise ValueError(f"{method} reads one site; {site!r} names several (methods of several sites: "
                             f"{', '.join(KEY_FORMS)})")
        if site is not None and site not in sites:
            raise ValueError(f"extractor {name or method!r} reads site {site!r}, which is not among the sites "
                             f"{sites}")
        for s in [site] if site else sites:
            full = name or (method if len(sites) == 1 else f"{s}__{method}")
            full = full if site or len(sites) == 1 or not name else f"{s}__{name}"
            _claim(names, check_name(full, "extractor name"), method)
            out.append({"method": method, "name": full, "site": s, **spec})
    return out


def _claim(names: dict[str, bool], full: str, method: str) -> None:
    if full in names:
        raise ValueError(f"two extractors are named {full!r}; give each its own name= "
                         f"(e.g. --extractor '{method}:name={method}_2,...')")
    names[full] = True


def extractor_key(spec: dict[str, Any]) -> Key:
    """The fit key of a checked extractor entry: its site, or the sites its `site` spells."""
    return parse_key(spec["site"], KEY_FORMS.get(spec["method"], "site"))


def entry_budget(spec: dict[str, Any], max_tokens: int | None) -> int | None:
    """The tokens entry `spec` is fed in a fit of `max_tokens`: its own `max_tokens` when smaller."""
    own = spec.get(BUDGET)
    return max_tokens if own is None else own if max_tokens is None else min(own, max_tokens)


def budget_lr(spec: dict[str, Any], max_tokens: int | None) -> float | None:
    """The Adam lr `short_budget_lr` gives SAE entry `spec` for a fit of `max_tokens` tokens, or of its
    own `max_tokens` when smaller (`entry_budget`; steps: budget // batch_size, its batch_size or the
    config's default); None for another method, an unknown budget (the whole source), or a width or
    batch its constructor will refuse."""
    from conceptlens.concepts.sae.config import SAEConfig, short_budget_lr

    max_tokens = entry_budget(spec, max_tokens)
    config = getattr(method_class(spec["method"]), "Config", None)
    if max_tokens is None or not (isinstance(config, type) and issubclass(config, SAEConfig)):
        return None
    default = {f.name: f.default for f in dataclasses.fields(config)}["batch_size"]
    width: Any = spec.get("width")
    batch: Any = spec.get("batch_size", default)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (width, batch, max_tokens)):
        return None  # the constructor names what is wrong
    return short_budget_lr(width, max(1, max_tokens // batch), batch)
