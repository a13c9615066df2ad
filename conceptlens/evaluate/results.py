"""The suite's results in a run folder, `RUN/eval.json`: written by `conceptlens eval`, read by the report.

    save_part(run, Part(model, sets, site, "probing bbc-news", config, seconds), lines)  # merged, atomically
    ev = load_results(run)            # None without the file; ValueError naming the field when malformed
    ev.lines, ev.sets["topk"].sha256, ev.interval

Format `conceptlens.Evaluation` version 1 (JSON; NaN written as null):
- `model`, `interval` (how the 95% intervals were computed);
- `sets`: name -> {site, method, n_concepts, sha256 (of the ConceptSet's tensors, as its
  config.json records it), activation};
- `parts`: one per (site, part) run: {site, part, sets, config (the SuiteConfig), seconds};
- `lines`: one per figure: {site, part, extractor, concept (null: the whole set), metric,
  value: [value, low, high], baselines: [[name, [value, low, high]], ...], note,
  higher_is_better, verdict (against the first baseline)}.

Each finished part is merged in at once, so an interrupted `eval` keeps what it finished. A part
run again replaces its lines for the sets it ran (all of its lines when its config changed); a
set refitted since (another sha256) loses every earlier line. A file of another model, or one that
does not read, is refused (`check_file`, which `conceptlens eval` calls before the model loads):
nothing a user computed is replaced without being asked.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from conceptlens import _content
from conceptlens._io import atomic_write
from conceptlens.evaluate.bootstrap import Estimate
from conceptlens.evaluate.lines import Line, verdict

FILE = "eval.json"
FORMAT = "conceptlens.Evaluation"
JUDGE = "(judge)"
"""The `extractor` of lines about a part's own instrument, not a set: the steering judges' held-out
accuracy (no set can be named so: parentheses are not in a set's name)."""
INSTRUMENTS = (JUDGE,)


class SetInfo(NamedTuple):
    site: str
    method: str
    n_concepts: int
    sha256: str | None
    """the digest of the set's tensors its config.json records (None: a set saved without one)"""
    activation: str = ""


class Part(NamedTuple):
    model: str
    sets: dict[str, SetInfo]
    """the sets this part ran on"""
    site: str
    part: str
    """as `suite.run_parts` names it: "reconstruction", "probing bbc-news", ..."""
    config: dict[str, Any]
    seconds: float


class SavedLine(NamedTuple):
    site: str
    part: str
    line: Line


class Results(NamedTuple):
    model: str
    interval: str
    sets: dict[str, SetInfo]
    parts: list[dict[str, Any]]
    lines: list[SavedLine]


def set_digest(folder: str | os.PathLike) -> str | None:
    """The sha256 of a saved ConceptSet's tensors, as `folder/config.json` records it (None: none there)."""
    config = Path(folder) / "config.json"
    data = _content.read_json(config) if config.is_file() else None
    sha = data.get("sha256") if isinstance(data, dict) else None
    return sha if isinstance(sha, str) else None


def set_info(cs: Any, folder: str | os.PathLike, site: str, activation: str = "") -> SetInfo:
    """What identifies a fitted set in the file: its site, method, size and `set_digest`."""
    return SetInfo(site, str(cs.method or ""), int(cs.directions.shape[0]), set_digest(folder), activation)


def interval_text(random_draws: int) -> str:
    from conceptlens.evaluate.bootstrap import DRAWS

    return (f"95% intervals: percentile bootstrap over held-out documents ({DRAWS} replicates); the random-direction "
            f"control pools its {random_draws} draws with the replicates. The fit is not repeated over seeds.")


def _est(e: Estimate) -> list[float | None]:
    return [None if math.isnan(v) else float(v) for v in e]


def _record(site: str, part: str, ln: Line) -> dict[str, Any]:
    return {"site": site, "part": part, "extractor": ln.extractor, "concept": ln.concept, "metric": ln.metric,
            "value": _est(ln.value), "baselines": [[name, _est(e)] for name, e in ln.baselines], "note": ln.note,
            "higher_is_better": ln.higher_is_better, "verdict": verdict(ln)}


def save_part(run: str | os.PathLike, part: Part, lines: Sequence[Line], interval: str = "") -> Path:
    """Merge one finished part into `run/eval.json` (see the module docstring), atomically, holding
    the run folder's lock for the read and the write."""
    from conceptlens.runlock import lock

    path = Path(run) / FILE
    with lock(run, "eval", create=False):
        data = _merge(_read_raw(path, part.model), part, lines, interval)
        text = json.dumps(data, indent=1, allow_nan=False)
        atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return path


def check_file(run: str | os.PathLike, model: str) -> None:
    """Refuse, in one line, a `run/eval.json` that parts of `model` may not be merged into: one that
    does not read (`load_results`'s error) or one of another model."""
    _read_raw(Path(run) / FILE, model)


def _read_raw(path: Path, model: str) -> dict[str, Any] | None:
    """The earlier file (None: there is none); a ValueError when it does not read or is another model's."""
    if not path.is_file():
        return None
    try:
        load_results(path.parent)
    except ValueError as e:
        raise ValueError(f"{e}; move it away to start a new file (it is not replaced)") from None
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("model") != model:
        raise ValueError(f"{path} holds figures of the model {data.get('model')!r}, not {model!r}: pass "
                         f"--model {data.get('model')!r}, or move it away to start a new file (it is not replaced)")
    return data


def _merge(old: dict[str, Any] | None, part: Part, lines: Sequence[Line], interval: str) -> dict[str, Any]:
    old = old or {"format": FORMAT, "version": 1, "model": part.model, "sets": {}, "parts": [], "lines": []}
    config = json.loads(json.dumps({k: v for k, v in part.config.items() if k != "progress"}))  # as read back
    sets = dict(old["sets"])
    refitted = {n for n, s in part.sets.items() if n in sets and sets[n].get("sha256") != s.sha256}
    sets.update({n: s._asdict() for n, s in part.sets.items()})
    key = (part.site, part.part)
    earlier = next((p for p in old["parts"] if (p["site"], p["part"]) == key), None)
    same = earlier is not None and earlier["config"] == config
    ran = {*part.sets, *INSTRUMENTS}  # a part run again replaces its instruments' lines too
    kept = [r for r in old["lines"] if r["extractor"] not in refitted
            and not ((r["site"], r["part"]) == key and (not same or r["extractor"] in ran))]
    kept_sets = sorted({*part.sets, *(s for s in (earlier or {}).get("sets", []) if same and s not in refitted)})
    parts = [p for p in old["parts"] if (p["site"], p["part"]) != key]
    parts.append({"site": part.site, "part": part.part, "sets": kept_sets, "config": config,
                  "seconds": round(part.seconds, 1)})
    return {**old, "interval": interval or old.get("interval", ""), "sets": sets, "parts": parts,
            "lines": kept + [_record(part.site, part.part, ln) for ln in lines]}


def load_results(run: str | os.PathLike) -> Results | None:
    """`run/eval.json` checked field by field (a run folder may come from anyone), or None."""
    path = Path(run) / FILE
    if not path.is_file():
        return None
    data = _content.field(path, "the file", _content.read_json(path), dict)
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: format must be {FORMAT!r}; got {_content.field(path, 'format', data.get('format'), str)!r}")
    sets = {}
    for name, s in _content.field(path, "sets", data.get("sets"), dict).items():
        where = f"{path}: sets[{name!r}]"
        s = _content.field(where, "the entry", s, dict)
        sets[name] = SetInfo(_content.field(where, "site", s.get("site"), str),
                             _content.field(where, "method", s.get("method"), str),
                             _content.field(where, "n_concepts", s.get("n_concepts"), int, low=0, high=_content.MAX_COUNT),
                             _content.field(where, "sha256", s.get("sha256"), str, optional=True),
                             _content.field(where, "activation", s.get("activation", ""), str))
    lines = [_saved_line(f"{path}: lines[{i}]", r, sets)
             for i, r in enumerate(_content.field(path, "lines", data.get("lines"), list))]
    parts = [_content.field(f"{path}: parts[{i}]", "the entry", p, dict)
             for i, p in enumerate(_content.field(path, "parts", data.get("parts"), list))]
    return Results(_content.field(path, "model", data.get("model"), str),
                   _content.field(path, "interval", data.get("interval", ""), str), sets, parts, lines)


def _estimate(where: str, name: str, v: Any) -> Estimate:
    v = _content.field(where, name, v, list)
    if len(v) != 3:
        raise ValueError(f"{where}: {name} must be [value, low, high]; got {len(v)} numbers")
    return Estimate(*(math.nan if x is None else float(_content.field(where, name, x, (int, float))) for x in v))


def _saved_line(where: str, r: Any, sets: dict[str, SetInfo]) -> SavedLine:
    r = _content.field(where, "the entry", r, dict)
    text = {k: _content.field(where, k, r.get(k, ""), str) for k in ("site", "part", "extractor", "metric", "note")}
    if text["extractor"] not in sets and text["extractor"] not in INSTRUMENTS:
        raise ValueError(f"{where}: extractor {text['extractor']!r} is not one of the sets {sorted(sets)}")
    n = sets[text["extractor"]].n_concepts if text["extractor"] in sets else 0  # an instrument has no concepts
    concept = _content.field(where, "concept", r.get("concept"), int, low=0, high=max(n - 1, 0), optional=True)
    bases = []
    for j, b in enumerate(_content.field(where, "baselines", r.get("baselines", []), list)):
        b = _content.field(where, f"baselines[{j}]", b, list)
        if len(b) != 2:
            raise ValueError(f"{where}: baselines[{j}] must be [name, [value, low, high]]")
        bases.append((_content.field(where, f"baselines[{j}] name", b[0], str), _estimate(where, f"baselines[{j}]", b[1])))
    line = Line(text["extractor"], text["metric"], _estimate(where, "value", r.get("value")), bases, text["note"],
                _content.field(where, "higher_is_better", r.get("higher_is_better", True), bool), concept)
    return SavedLine(text["site"], text["part"], line)
