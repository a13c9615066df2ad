"""Read a run folder (concepts/, describe/, fit_report.json, ...) for the report.

    atlas = Atlas.load("runs/demo")
    for ex in atlas.extractors:            # one per describe/<NAME>/
        ex.name, ex.site, ex.n, ex.stats["frequency"], ex.contexts()

The layout is the run-folder contract written by `conceptlens fit` / `describe`
(see DESIGN.md, "Atlas run folder"), with the evaluation suite's `eval.json` and the peers'
`peers.json` when present. Statistics are read as numpy arrays; contexts are
streamed line by line so that 4096 concepts never sit in memory as Python objects at once.
"""

from __future__ import annotations

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the run config is shown only when tomllib exists
    tomllib = None  # type: ignore[assignment]
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from conceptlens import _content
from conceptlens._content import parse_json, read_json, read_toml
from conceptlens._names import check_name
from conceptlens.evaluate.results import Results, load_results
from conceptlens.report.evaluation import load_peers

DESCRIPTION_FORMAT = "conceptlens.Description"
CONTROL_METHODS = ("random",)  # as describe.run's: descriptions written before the "control" field


@dataclass
class ExtractorView:
    """One extractor's description (and its ConceptSet's directions, when saved)."""

    name: str
    folder: Path
    meta: dict[str, Any]
    stats: dict[str, np.ndarray]
    tokens: dict[str, list[list[str]]] | None
    directions: np.ndarray | None = field(default=None, repr=False)
    fit_tokens: int | None = None
    """Tokens its fit fed it (the set's config.json), when saved: below the run's with a budget of its own."""

    @property
    def site(self) -> str:
        return str(self.meta.get("site") or "")

    @property
    def method(self) -> str:
        return str(self.meta.get("method") or "")

    @property
    def n(self) -> int:
        return int(self.meta["n_concepts"])

    @property
    def labels(self) -> list[str] | None:
        return self.meta.get("labels")

    def contexts(self) -> Iterator[list[dict[str, Any]]]:
        """The top contexts of each concept, in concept order (one JSON line each)."""
        path = self.folder / "contexts.jsonl"
        if not path.is_file():
            for _ in range(self.n):
                yield []
            return
        lines = 0
        with open(path, encoding="utf-8") as f:
            for expected, line in enumerate(f):
                where = f"{path}: line {expected + 1}"
                record = _content.field(where, "the record", parse_json(line, where), dict)
                if record.get("concept") != expected or expected >= self.n:
                    raise ValueError(f"{path}: line {expected + 1} is concept {record.get('concept')!r}, "
                                     f"expected {expected} (one line per concept, in order, n_concepts={self.n})")
                lines += 1
                yield _content.field(where, "contexts", record.get("contexts", []), list)
        if lines != self.n:
            raise ValueError(f"{path} holds {lines} lines for n_concepts={self.n} (one line per concept): the "
                             "description is damaged; run describe again")

    @property
    def control(self) -> bool:
        """A baseline set (random directions): shown as control rows, never as concepts."""
        return _is_control(self.meta)

    def steering(self) -> dict[int, dict[str, Any]]:
        return {int(s["concept"]): s for s in self.meta.get("steering") or []}


@dataclass
class Atlas:
    """Everything the report shows about one run folder."""

    run: Path
    extractors: list[ExtractorView]
    """The concept sets (controls left out)."""
    config: dict[str, Any]
    fit_report: dict[str, Any] | None
    quality: dict[str, Any] | None
    hierarchies: dict[str, dict[str, Any]]
    controls: list[ExtractorView] = field(default_factory=list)
    """Baselines described alongside (random directions): quality-table rows, no pages."""
    evaluation: Results | None = None
    """`eval.json`: the evaluation suite's figures (`conceptlens eval`), when it ran"""
    peers: dict[str, Any] | None = None
    """`peers.json`: our SAEs next to SAELens's and sparsify's trainers (`benchmarks/peers.py --json`)"""

    @classmethod
    def load(cls, run: str | os.PathLike) -> Atlas:
        run = Path(run)
        if not run.is_dir():
            raise FileNotFoundError(f"no run folder {run}")
        describe = run / "describe"
        names = sorted(p.name for p in describe.iterdir() if (p / "description.json").is_file()) \
            if describe.is_dir() else []
        if not names:
            raise FileNotFoundError(_no_descriptions(run))
        for name in names:  # a run folder from elsewhere may hold any name: it becomes a path and a URL
            check_name(name, f"{describe}: extractor folder")
        fit_report = _read_json(run / "fit_report.json")
        fitted = fit_report.get("concepts") if isinstance(fit_report, dict) else None
        if isinstance(fitted, list):  # a set the last fit did not write (its folder stayed) is an earlier run's;
            # a control (random directions) is made by the description pass, not by the fit
            stale = [n for n in names if n not in fitted and not _described_as_control(describe / n)
                     and (run / "concepts" / n / "concepts.safetensors").is_file()]
            if stale:
                warnings.warn(f"left out of the atlas: {', '.join(stale)}, from an earlier fit in {run} (the last fit, "
                              "fit_report.json, wrote no such set)", stacklevel=2)
            names = [n for n in names if n not in stale]
        views = [_load_extractor(run, name) for name in names]
        if all(v.control for v in views):
            raise ValueError(f"{run}/describe holds only controls ({', '.join(names)}): describe a concept set too")
        return cls(
            run=run,
            extractors=[v for v in views if not v.control],
            controls=[v for v in views if v.control],
            config=_read_toml(run / "run.toml"),
            fit_report=fit_report,
            quality=_read_json(run / "quality.json"),
            hierarchies=_load_hierarchies(run, {v.name: v.n for v in views if not v.control}),
            evaluation=load_results(run),
            peers=load_peers(run),
        )

    def extractor(self, name: str) -> ExtractorView:
        for ex in self.extractors:
            if ex.name == name:
                return ex
        raise KeyError(f"no extractor {name!r} in {self.run}; it has {[e.name for e in self.extractors]}")


def _no_descriptions(run: Path) -> str:
    """Why `run` holds nothing to show, and the command that makes it: describe for a run, the report
    of its run for a concept set folder."""
    from conceptlens.concepts.conceptset import CONFIG_FILE

    if (run / "run.toml").is_file():
        return f"{run} has no describe/<NAME>/description.json: run `conceptlens describe {run}` first"
    if (run / CONFIG_FILE).is_file() and run.parent.name == "concepts" and (run.parent.parent / "run.toml").is_file():
        return f"{run} is a concept set of the run {run.parent.parent}: `conceptlens report {run.parent.parent}` shows it"
    what = "a concept set folder" if (run / CONFIG_FILE).is_file() else "no run folder"
    return f"{run} is {what}: a report shows a run folder that `conceptlens fit` wrote (with its run.toml)"


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    return read_json(path)


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file() or tomllib is None:
        return {}
    return read_toml(path)


def _is_control(meta: dict[str, Any]) -> bool:
    return bool(meta.get("control", meta.get("method") in CONTROL_METHODS))


def _described_as_control(folder: Path) -> bool:
    meta = _read_json(folder / "description.json")
    return isinstance(meta, dict) and _is_control(meta)


def _load_extractor(run: Path, name: str) -> ExtractorView:
    from conceptlens._io import read_safetensors

    folder = run / "describe" / name
    meta = _read_json(folder / "description.json")
    if not isinstance(meta, dict) or meta.get("format") != DESCRIPTION_FORMAT:
        raise ValueError(f"{folder / 'description.json'} is not a description (expected format {DESCRIPTION_FORMAT!r})")
    stats_path = folder / "stats.safetensors"
    if not stats_path.is_file():
        raise FileNotFoundError(f"{stats_path} not found: a description folder holds description.json and stats.safetensors")
    stats = read_safetensors(stats_path, "numpy", "the description is damaged; run describe again")[0]
    n = _content.field(folder / "description.json", "n_concepts", meta.get("n_concepts"), int, low=0,
                       high=_content.MAX_COUNT)
    if n and not stats:  # every description records each concept's frequency: n pages need n rows of something
        raise ValueError(f"{stats_path} holds no per-concept statistics; n_concepts={n} in description.json is "
                         "backed by nothing (the description is incomplete: run describe again)")
    for key, value in stats.items():
        if value.shape[:1] != (n,):
            raise ValueError(f"{stats_path}: {key} has shape {value.shape}; its first dimension must be n_concepts={n}")
    return ExtractorView(name, folder, meta, stats, _read_tokens(folder / "tokens.json", n, stats),
                         *_saved_set(run / "concepts" / name, n, meta.get("set_sha256"), run))


def _read_tokens(path: Path, n: int, stats: dict[str, np.ndarray]) -> dict[str, Any] | None:
    """`tokens.json` (None without it): promoted / suppressed, each a list of n lists of strings, no
    longer than the rows of their logits in stats.safetensors; a one-line ValueError naming the field."""
    data = _read_json(path)
    if data is None:
        return None
    _content.field(path, "the file", data, dict)
    for key in ("promoted", "suppressed"):
        rows = _content.field(path, key, data.get(key), list, optional=True)
        if rows is None:
            continue
        if len(rows) != n:
            raise ValueError(f"{path}: {key} holds {len(rows)} lists; the description has {n} concepts")
        logits = stats.get(f"{key}_logit")
        most = logits.shape[1] if logits is not None and logits.ndim == 2 else None
        for i, row in enumerate(rows):
            if not isinstance(row, list) or not all(isinstance(t, str) for t in row):
                raise ValueError(f"{path}: {key}[{i}] must be a list of token strings; got {str(row)[:60]}")
            if most is not None and len(row) > most:
                raise ValueError(f"{path}: {key}[{i}] holds {len(row)} tokens; stats.safetensors has {most} "
                                 f"{key} logits per concept")
    return data


def _saved_set(folder: Path, n: int, described: Any = None, run: Path | None = None
               ) -> tuple[np.ndarray | None, int | None]:
    """The extractor's ConceptSet, when saved: its unit directions (centred when it carries the fit's
    mean, as the description measures them) and the tokens its fit fed it (config.fit.tokens, as `fit`
    records them; None when not recorded); (None, None) when it was not saved. A set that is not the
    one its description describes (`described`: the description's set_sha256; a fit ran on since)
    is refused in one line."""
    if not (folder / "concepts.safetensors").is_file():
        return None, None
    from conceptlens.concepts.conceptset import ConceptSet

    cs = ConceptSet.load(folder)
    if isinstance(described, str) and cs.digest() != described:
        raise ValueError(f"describe/{folder.name} describes an earlier fit of {folder} (the set has been fitted "
                         f"again since): run `conceptlens describe {run or folder.parent.parent}` first")
    d = (cs.centred() if cs.mean is not None else cs).directions.numpy().astype(np.float32)  # as the activations
    if d.shape[0] != n:
        raise ValueError(f"{folder} holds {d.shape[0]} concepts but its description says {n}")
    fit = cs.config.get("fit")
    tokens = fit.get("tokens") if isinstance(fit, dict) else None
    fed = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0 else None
    return d / np.maximum(np.linalg.norm(d, axis=1, keepdims=True), 1e-12), fed


def _acyclic(path: Path, data: dict[str, Any]) -> None:
    """A one-line ValueError naming a cycle when the hierarchy's edges form one (a hierarchy is a DAG)."""
    import networkx as nx

    from conceptlens.report.hierarchy_page import dag_from_json

    try:
        cycle = nx.find_cycle(dag_from_json(data))
    except nx.NetworkXNoCycle:
        return
    except (nx.NetworkXError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a node-link graph ({e})") from None
    loop = " -> ".join(str(u) for u, _ in cycle) + f" -> {cycle[0][0]}"
    raise ValueError(f"{path}: its edges form a cycle ({loop}); a hierarchy is a DAG (parent -> child)")


def _load_hierarchies(run: Path, sizes: dict[str, int]) -> dict[str, dict[str, Any]]:
    """`hierarchy/<NAME>.json` (node-link, as `metrics.hierarchy.export_dag` writes it) per extractor,
    its node ids checked against the extractor's number of concepts."""
    out = {}
    for name, n in sizes.items():
        path = run / "hierarchy" / f"{name}.json"
        data = _read_json(path)
        if data is not None:
            _content.field(path, "the file", data, dict)
            edges = "edges" if "edges" in data else "links"
            for key, ends in (("nodes", ("id",)), (edges, ("source", "target"))):
                for i, item in enumerate(_content.field(path, key, data.get(key), list)):
                    for end in ends:
                        value = item.get(end) if isinstance(item, dict) else None
                        _content.field(path, f"{key}[{i}].{end}", value, int, low=0, high=n - 1)
            _acyclic(path, data)
            out[name] = data
    return out
