"""The configuration of `conceptlens fit`: a TOML file and flags resolved into one RunConfig.

    model = "smollm2-135m"               # run.toml; every key optional except model, data, sites, extractor
    data = "bbc-news"
    sites = ["blocks.15.resid_out"]
    out = "runs/demo"
    [fit]
    batch_size = 16
    max_tokens = 50000
    [describe]
    max_tokens = 20000
    [[extractor]]
    method = "topk"
    width = 4608
    k = 32
    max_tokens = 30000                   # optional: this extractor's own budget, within the fit's

An extractor of several sites names them in its `site`: "SOURCE->TARGET" for a transcoder,
"A+B+C" for a crosscoder, "IN1+IN2->OUT1+OUT2" for a cross-layer transcoder (`sites` may then be
left out). Flags override the file (`--site` / `--extractor` replace the file's lists). A relative path
in the file (data, a model folder, out) is taken from the current folder, as a flag's is, not from
the file's folder; the run's own run.toml records data and model paths absolute. Everything is
checked here, before any model is loaded: unknown keys, methods and hyper-parameters, bad
numbers, a data source that does not exist, two extractors with one name. Site names are
checked by the model's own name resolver (`lens.site`) as soon as the model is attached, before
anything is written. `budget_lrs` gives each SAE entry without an lr the lr for the run's budget;
`to_toml` writes the resolved config back as `RUN/run.toml`.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import types
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from conceptlens._checks import check_int
from conceptlens._content import read_toml as read_checked_toml
from conceptlens.commands._common import DTYPES as MODEL_DTYPES
from conceptlens.commands.extractor_specs import (BUDGET, KEY_FORMS, METHODS, budget_lr,  # noqa: F401
                                                  check_extractors, entry_budget, extractor_key, method_class,
                                                  parse_extractor)
from conceptlens.concepts import registry
from conceptlens.fit_config import FitConfig
from conceptlens.fit_keys import Key

@dataclass
class FitSection:
    """The [fit] table: the `FitConfig` fields a run.toml sets, with FitConfig's defaults (the
    command sets the others: checkpoint_dir is the run folder, progress and distributed come
    from the processes)."""

    batch_size: int = FitConfig.batch_size
    max_length: int = FitConfig.max_length
    max_tokens: int | None = FitConfig.max_tokens
    checkpoint_every: int | None = FitConfig.checkpoint_every
    resume: bool = FitConfig.resume


@dataclass
class DescribeSection:
    enabled: bool = True
    data: str | None = None
    """Documents to describe on; None: the documents after those the fit consumed (same source)."""
    max_tokens: int | None = 20_000
    top_n: int = 16
    window: tuple[int, int] = (8, 4)
    steer: list[str] = field(default_factory=list)
    """Concepts to record steering samples for, as "SET:INDEX" (e.g. "kmeans:12")."""
    prompt: str = "I went to the shop and"
    batch_size: int | None = None
    """Documents per batch of the description pass; None: the fit's. A fit under torchrun records its
    global batch (ranks x [fit] batch_size) here, which rank 0 describes with, as one process would."""


@dataclass
class RunConfig:
    model: str
    data: str
    sites: list[str]
    extractors: list[dict[str, Any]]
    """Each: method, name, site, and the method's hyper-parameters."""
    out: str = "runs/fit"
    shuffle: int | None = 0
    """Seed of the document order for bundled sets (they are stored sorted by label); None keeps it."""
    fit: FitSection = field(default_factory=FitSection)
    describe: DescribeSection = field(default_factory=DescribeSection)
    dtype: str | None = None
    """The model's weights dtype (--dtype; None: the loader's), so `describe RUN` and a resume load it so."""


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} not found")
    return read_checked_toml(path)


def _section(cls: type, values: Any, where: str) -> Any:
    if not isinstance(values, dict):
        raise ValueError(f"[{where}] must be a table; got {values!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} in [{where}]; valid keys: {', '.join(names)}")
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if not _is(value, hints[key]):
            raise ValueError(f"[{where}] {key} must be {_kind(hints[key])}; got {value!r}")
    if "window" in values:
        values = {**values, "window": tuple(values["window"])}
    return cls(**values)


def _is(value: Any, hint: Any) -> bool:
    """Whether a TOML value has the type a section field declares (bool is no int here)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is(value, a) for a in args)
    if origin in (list, tuple):  # TOML arrays come as lists
        return isinstance(value, (list, tuple)) and all(_is(v, args[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint) and (hint is bool or not isinstance(value, bool))


def _kind(hint: Any) -> str:
    """A field's type in words: "an integer", "a list of strings", "a string or nothing"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_kind(a) for a in args if a is not type(None))
    if origin in (list, tuple):
        return f"a list of {_kind(args[0]).split(' ', 1)[1]}s"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def from_dict(raw: dict[str, Any]) -> RunConfig:
    """A RunConfig from a TOML document (after flags were merged into it), fully checked."""
    top = [f.name for f in dataclasses.fields(RunConfig) if f.name != "extractors"] + ["extractor"]
    unknown = sorted(set(raw) - set(top))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}; valid keys: {', '.join(top)}")
    for key in ("model", "data"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise ValueError(f"{key} must be one name or path, e.g. {key} = \"...\"; got {raw[key]!r}"
                             + (" (one fit reads one source: join the files into one .txt or .jsonl)"
                                if key == "data" and isinstance(raw[key], list) else ""))
        if not raw.get(key):
            raise ValueError(f"no {key} given: pass --{key} or set {key} = \"...\" in the config file")
    sites = raw.get("sites") or []
    if isinstance(sites, str):
        sites = [sites]
    if not isinstance(sites, list):
        raise ValueError(f"sites must be a site name or a list of them, e.g. sites = [\"blocks.15.resid_out\"]; "
                         f"got {sites!r}")
    specs = raw.get("extractor") or []
    if not isinstance(specs, list) or not all(isinstance(e, dict) for e in specs):
        raise ValueError("extractor must be an array of tables ([[extractor]] in the file, one per extractor; "
                         f"--extractor 'topk:width=4608,k=32' on the command line); got {specs!r}")
    if not sites and (not specs or not all(isinstance(e, dict) and registry.canonical(str(e.get("method"))) in KEY_FORMS
                                  for e in specs)):
        raise ValueError(f"no site given: pass --site, e.g. blocks.3.resid_out (repeatable), or sites = [...] in the "
                         f"file; list the model's with: conceptlens sites --model {shlex.quote(raw['model'])}")
    for site in sites:  # which names are sites depends on the model: its own resolver checks them once it loads
        if not isinstance(site, str) or not site.strip():
            raise ValueError(f"{site!r} is not a site name; sites look like embed, blocks.15.resid_out, "
                             "blocks.3.attn.z, final (list them: conceptlens sites --model M)")
    shuffle = shuffle_seed(raw)
    out = raw.get("out", "runs/fit")
    if not isinstance(out, str) or not out.strip():
        raise ValueError(f"out {out!r} is not a folder: give the run folder, e.g. --out runs/x")
    dtype = model_dtype(raw)
    cfg = RunConfig(raw["model"], raw["data"], list(sites), [], out=out,
                    shuffle=shuffle, fit=_section(FitSection, raw.get("fit", {}), "fit"),
                    describe=_section(DescribeSection, raw.get("describe", {}), "describe"), dtype=dtype)
    cfg.extractors = check_extractors(specs, cfg.sites)
    _check_numbers(cfg)
    _check_steer(cfg)
    return cfg


def model_dtype(raw: dict[str, Any]) -> str | None:
    """The model's dtype a run's settings give (`dtype`, None when absent); anything else is refused in one line."""
    dtype = raw.get("dtype")
    if dtype is not None and dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not a model dtype; valid: {', '.join(MODEL_DTYPES)}")
    return dtype


def shuffle_seed(raw: dict[str, Any]) -> int | None:
    """The seed of the documents' order a run's settings give (`shuffle`, 0 when absent), or None for
    `shuffle = false` (the stored order); anything else is refused in one line."""
    shuffle = raw.get("shuffle", 0)
    if shuffle is not False and (isinstance(shuffle, bool) or not isinstance(shuffle, int)):
        raise ValueError(f"shuffle must be a seed (an integer) or false; got {shuffle!r}")
    return None if shuffle is False else shuffle


def _check_steer(cfg: RunConfig) -> None:
    """describe.steer names SET:INDEX of this run's extractors (before any model loads)."""
    from conceptlens.describe.steering import _named

    names = [e["name"] for e in cfg.extractors]
    for item in cfg.describe.steer:
        name, _ = _named(item)
        if name not in names:
            raise ValueError(f"describe.steer (--steer) names set {name!r}; this run's sets are {', '.join(names)}")


def _check_numbers(cfg: RunConfig) -> None:
    for section, key, flag in (("fit", "batch_size", "--batch-size"), ("fit", "max_length", "--max-length"),
                               ("fit", "max_tokens", "--max-tokens"), ("fit", "checkpoint_every", "--checkpoint-every"),
                               ("describe", "max_tokens", "--describe-tokens"), ("describe", "top_n", "--top-n"),
                               ("describe", "batch_size", "run.toml")):
        value = getattr(getattr(cfg, section), key)
        if value is not None:  # TOML has no null: None is only a default (the whole source)
            check_int(f"{section}.{key} ({flag})", value)  # at most int64, as islice and torch take
    window = cfg.describe.window
    if len(window) != 2 or any(not isinstance(w, int) or w < 0 for w in window):
        raise ValueError(f"describe.window must be two integers >= 0 (tokens left, right); got {list(window)}")


def build(cfg: RunConfig) -> dict[Key, dict[str, Any]]:
    """{key: {name: extractor}} (constructing them checks their hyper-parameters; no model needed)."""
    plan: dict[Key, dict[str, Any]] = {}
    for spec in cfg.extractors:
        options = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()
                   if k not in ("method", "name", "site", BUDGET)}
        try:
            extractor = method_class(spec["method"])(**options)
        except TypeError as err:
            raise ValueError(f"extractor {spec['name']!r} ({spec['method']}): {err}") from None
        plan.setdefault(extractor_key(spec), {})[spec["name"]] = extractor
    return plan


def extractor_tokens(cfg: RunConfig) -> dict[str, int]:
    """{name: tokens} of the entries with their own `max_tokens` (`FitConfig.extractor_tokens`)."""
    return {spec["name"]: spec[BUDGET] for spec in cfg.extractors if BUDGET in spec}


def budget_lrs(cfg: RunConfig, recorded: RunConfig | None = None) -> dict[str, float]:
    """Give each SAE entry that sets no `lr` the lr for the run's budget (`budget_lr`), in place, so
    run.toml records it; returns {name: lr} of those set. An entry the folder's run `recorded` holds
    (same name and method: a resumed fit) keeps that run's lr, or its absence, whatever the budget
    now (and is not returned). `lr` given (`lr=none`: the library's width rule) is kept."""
    before = {e["name"]: e for e in recorded.extractors} if recorded is not None else {}
    chosen: dict[str, float] = {}
    for spec in cfg.extractors:
        if "lr" in spec:
            continue
        old = before.get(spec["name"])
        if old is not None and old["method"] == spec["method"]:  # a resumed fit: the run's lr, or none
            spec.update({"lr": old["lr"]} if "lr" in old else {})
            continue
        lr = budget_lr(spec, cfg.fit.max_tokens)
        if lr is not None:
            spec["lr"] = chosen[spec["name"]] = lr
    return chosen


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    raw = asdict(cfg)
    raw["extractor"] = raw.pop("extractors")
    raw["shuffle"] = False if cfg.shuffle is None else cfg.shuffle
    raw["describe"]["window"] = list(cfg.describe.window)
    return raw


def to_toml(cfg: RunConfig) -> str:
    """The resolved config as TOML (None values are left out: TOML has no null)."""
    raw = to_dict(cfg)
    lines = [f"{k} = {_toml(v)}" for k, v in raw.items() if not isinstance(v, (dict, list)) or k == "sites"
             if v is not None]
    for section in ("fit", "describe"):
        lines += ["", f"[{section}]"] + [f"{k} = {_toml(v)}" for k, v in raw[section].items() if v is not None]
    for spec in raw["extractor"]:
        lines += ["", "[[extractor]]"] + [f"{k} = {_toml(v)}" for k, v in spec.items() if v is not None]
    return "\n".join(lines) + "\n"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):  # JSON's escapes are TOML's; TOML also forbids a raw DEL
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")
