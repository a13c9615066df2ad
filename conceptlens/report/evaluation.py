"""The evaluation suite in the atlas: the index's table from `RUN/eval.json`, each concept's own
scores on its page, and the peers' table from `RUN/peers.json`.

    suite = Suite.of(atlas)              # None when the run has no eval.json
    suite.block()                        # the index's section: one table per part, then the peers'
    concept_scores(suite.by_concept().get(("topk", 5), ()), suite.note("topk"))   # a concept page's block

Only figures of sets whose ConceptSet is the one evaluated are shown (the sha256 of its tensors,
as `concepts/<NAME>/config.json` records it, equals the one in eval.json); figures of a set
refitted since are left out and a banner says so. Every string passes through `html.esc`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from conceptlens import _content
from conceptlens._names import is_name
from conceptlens.evaluate.bootstrap import Estimate
from conceptlens.evaluate.lines import Line, verdict
from conceptlens.evaluate.results import Results, SavedLine, set_digest
from conceptlens.report.html import esc, num, table
from conceptlens.report.legends import LEGENDS, figure

PEERS_FILE = "peers.json"
PEERS_FORMAT = "conceptlens.Peers"
PEER_FIGURES = (("tokens", "tokens"), ("seconds", "step time (s)"), ("fvu", "FVU"), ("l0", "L0"),
                ("ce_recovered", "CE loss recovered"))


@dataclass
class Suite:
    """The current figures of a run's eval.json, and its peers' table."""

    results: Results
    lines: list[SavedLine]
    """the figures of sets evaluated as they are now"""
    stale: list[str]
    """sets refitted (or removed) since they were evaluated"""
    controls: set[str]
    peers: dict[str, Any] | None = None

    @classmethod
    def of(cls, atlas: Any) -> Suite | None:
        if atlas.evaluation is None:
            return None
        res = atlas.evaluation
        folder = atlas.run / "concepts"  # a name that is no safe folder name names no set of this run
        stale = sorted(n for n, s in res.sets.items() if not is_name(n) or set_digest(folder / n) != s.sha256
                       or s.sha256 is None and not (folder / n).is_dir())
        return cls(res, [sl for sl in res.lines if sl.line.extractor not in stale], stale,
                   {c.name for c in atlas.controls}, atlas.peers)

    def by_concept(self) -> dict[tuple[str, int], list[SavedLine]]:
        """(set, concept) -> its figures, for the concept pages."""
        out: dict[tuple[str, int], list[SavedLine]] = {}
        for sl in self.lines:
            if sl.line.concept is not None:
                out.setdefault((sl.line.extractor, sl.line.concept), []).append(sl)
        return out

    def note(self, name: str) -> str:
        """What a concept page without figures of its own says (empty: the suite scored no single concept of `name`)."""
        tops = {p["config"].get("concept_top") for p in self.results.parts if isinstance(p.get("config"), dict)
                and name in (p.get("sets") or []) and str(p.get("part", "")).startswith("probing")}
        tops = {t for t in tops if isinstance(t, int) and t > 0}
        if name in self.stale or not tops:
            return ""
        return (f"The evaluation suite scored alone only the {max(tops)} concepts of {name} with the largest mean "
                "difference per probing task; this one was not among them.")

    def block(self) -> str:
        """The index's Evaluation section: the interval method, a table per (site, part), the peers."""
        parts: dict[tuple[str, str], list[Line]] = {}
        for sl in self.lines:
            if sl.line.concept is None:
                parts.setdefault((sl.site, sl.part), []).append(sl.line)
        out = [f'<h2>Evaluation suite</h2><p class="meta">model <code>{esc(self.results.model)}</code>; '
               f'{esc(self.results.interval)} Definitions and sources: EVALUATION.md.</p>']
        if self.stale:
            out.append(f'<p class="banner">{esc(", ".join(self.stale))}: refitted since the suite ran (or gone); '
                       f'their figures are left out. Run <code>conceptlens eval</code> again.</p>')
        tables = []
        for (site, part), lines in parts.items():
            rows = [(self._set_cell(ln.extractor), *_cells(ln)) for ln in lines]
            tables.append(f"<h3>{esc(part)} <span class=\"muted\">at <code>{esc(site)}</code></span></h3>"
                          + table(["set", *HEAD], rows, [False, False, True, True, False, False, False],
                                  attrs=' class="suite"'))
        if tables:  # one legend under all the parts' tables, not the same paragraph after each
            out.append(figure("".join(tables), LEGENDS["suite"]))
        return "".join(out) + peers_block(self.peers)

    def _set_cell(self, name: str) -> str:
        return f'<span class="control">{esc(name)} (control)</span>' if name in self.controls else esc(name)


HEAD = ["metric", "value [95% CI]", "matched control [95% CI]", "other baselines [95% CI]", "vs control", "note"]


def _est(e: Estimate) -> str:
    """A figure as HTML: the value, then its 95% interval (when it has one) in a smaller span; four
    decimals, as `conceptlens eval` prints it, so a column's figures line up and compare digit by digit."""
    if math.isnan(e.value):
        return ""
    return f"{e.value:.4f}" + ("" if math.isnan(e.low) else f' <span class="ci">[{e.low:.4f}, {e.high:.4f}]</span>')


def _cells(ln: Line) -> tuple[str, ...]:
    """metric, value, matched control, other baselines, verdict, note: escaped HTML cells."""
    first = f"{esc(ln.baselines[0][0])}<br>{_est(ln.baselines[0][1])}" if ln.baselines else ""
    others = "<br>".join(f"{esc(name)} {_est(e)}" for name, e in ln.baselines[1:])
    v = verdict(ln)
    mark = f'<span class="{ {"wins": "good", "loses": "bad"}.get(v, "muted") }">{esc(v)}</span>' if v else ""
    return esc(ln.metric), _est(ln.value), first, others, mark, esc(ln.note)


def concept_scores(lines: Sequence[SavedLine], note: str = "") -> str:
    """A concept page's block: its own figures from the suite (probe, steering), next to their controls."""
    if not lines:
        return f'<h2>Evaluation suite</h2><p class="muted">{esc(note)}</p>' if note else ""
    rows = [(esc(sl.part), *_cells(sl.line)) for sl in lines]
    html = table(["part", *HEAD], rows, [False, False, False, True, True, False, False, False],
                 attrs=' class="suite"')
    return "<h2>Evaluation suite: this concept's scores</h2>" + figure(html, LEGENDS["suite_concept"])


def load_peers(run: Any) -> dict[str, Any] | None:
    """`RUN/peers.json` (`benchmarks/peers.py --json`), checked field by field, or None."""
    path = run / PEERS_FILE
    if not path.is_file():
        return None
    data = _content.field(path, "the file", _content.read_json(path), dict)
    if data.get("format") != PEERS_FORMAT:
        raise ValueError(f"{path}: format must be {PEERS_FORMAT!r}; got {str(data.get('format'))[:40]!r}")
    for key in ("model", "site", "setup"):
        _content.field(path, key, data.get(key), str)
    for name, row in _content.field(path, "final", data.get("final"), dict).items():
        row = _content.field(path, f"final[{name!r}]", row, dict)
        for key, _ in PEER_FIGURES:
            _content.field(path, f"final[{name!r}].{key}", row.get(key), (int, float), optional=True)
    _content.field(path, "goals", data.get("goals", []), list)
    for i, g in enumerate(data.get("goals", [])):
        _content.field(path, f"goals[{i}]", g, str)
    return data


def _peer_cell(key: str, value: float | None) -> str:
    if key == "tokens" and value is not None:
        return f"{int(value):,}"
    return num(value, 3 if key == "seconds" else 4)


def peers_block(peers: dict[str, Any] | None) -> str:
    """Our SAEs and SAELens's and sparsify's trainers on the same rows (peers.json), when present."""
    if not peers:
        return ""
    rows = [(esc(name), *(_peer_cell(key, row.get(key)) for key, _ in PEER_FIGURES))
            for name, row in peers["final"].items()]
    html = table(["trainer", *(h for _, h in PEER_FIGURES)], rows, [False] + [True] * len(PEER_FIGURES),
                 attrs=' class="peers"')
    goals = "".join(f"<li>{esc(g.strip())}</li>" for g in peers.get("goals", []))
    return (f'<h3>Trainers side by side <span class="muted">{esc(peers["model"])} at <code>{esc(peers["site"])}'
            f'</code>: {esc(peers["setup"])}</span></h3>' + figure(html, LEGENDS["peers"])
            + (f"<ul class=\"goals\">{goals}</ul>" if goals else ""))
