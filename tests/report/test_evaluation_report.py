"""The evaluation suite in the atlas: the index's table and each concept page's scores rendered from a
saved `eval.json` (and `peers.json`), the fallback to the older quality table, sets refitted since,
escaping, and the report manifest."""

from __future__ import annotations

import json
import math
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.evaluate import results
from conceptlens.evaluate.bootstrap import Estimate
from conceptlens.evaluate.lines import Line
from conceptlens.report import write_report
from conceptlens.report.output import MANIFEST
from tests.report.atlas_fixture import write_fake_run

EXTRACTORS = [("topk", "topk-sae", 12), ("kmeans", "kmeans", 8)]
SITE = "blocks.1.resid_out"
NAN = math.nan


def fake_lines(names: dict[str, int], text: str = "") -> list[tuple[str, Line]]:
    """(part, line): per set a winning, an overlapping and a losing probe line, a reconstruction line without
    an interval, and concept 1's own score; `text` is put into every name, metric and note."""
    out = []
    for name, n in names.items():
        ctrl = (f"random {n} dirs{text}", Estimate(0.7, 0.65, 0.75))
        dom = (f"diff-of-means{text}", Estimate(0.8, 0.78, 0.83))
        out += [("probing toy", Line(name, f"toy k=1 accuracy{text}", Estimate(0.91, 0.88, 0.94), [ctrl, dom], f"n{text}")),
                ("probing toy", Line(name, f"toy k=5 accuracy{text}", Estimate(0.72, 0.6, 0.8), [ctrl, dom])),
                ("probing toy", Line(name, f"toy k=20 accuracy{text}", Estimate(0.5, 0.45, 0.55), [ctrl, dom])),
                ("reconstruction", Line(name, "FVU", Estimate(0.25, 0.2, 0.3), [("mean predictor", Estimate(1.0, NAN, NAN))],
                                        higher_is_better=False)),
                ("probing toy", Line(name, f"toy sport{text}: accuracy of this concept alone", Estimate(0.66, 0.61, 0.7),
                                     [(f"random {n} dirs, best 1", Estimate(0.55, 0.5, 0.6)), dom], "rank 1", concept=1))]
    return out


def write_fake_eval(run: Path, names: dict[str, int], text: str = "", model: str = "tiny") -> None:
    """eval.json as `conceptlens eval` writes it, for the sets `names` of a run from `write_fake_run`."""
    infos = {n: results.set_info(ConceptSet.load(run / "concepts" / n), run / "concepts" / n, SITE, "x") for n in names}
    lines = fake_lines(names, text)
    for part in dict.fromkeys(p for p, _ in lines):
        results.save_part(run, results.Part(model, infos, SITE, part, {"concept_top": 5}, 1.0),
                          [ln for p, ln in lines if p == part], "95% intervals: a bootstrap over documents.")


def write_fake_peers(run: Path, text: str = "") -> None:
    final = {f"ours-topk{text}": {"tokens": 49152, "seconds": 12.5, "fvu": 0.21, "l0": 32, "ce_recovered": 0.93},
             f"sparsify-topk{text}": {"tokens": 49152, "seconds": 20.0, "fvu": 0.24, "l0": 32, "ce_recovered": None}}
    (run / "peers.json").write_text(json.dumps({"format": "conceptlens.Peers", "version": 1, "model": "smollm2-135m",
                                                "site": "blocks.15.resid_out", "setup": f"49152 tokens{text}",
                                                "final": final, "goals": [f"  ours-topk vs sparsify{text} goal met"]}))


class _Tables(HTMLParser):
    """Text of each cell of each `<table class=...>` of a page, by class, and the page's h2/h3 headings."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.headings: list[str] = []
        self._cls = self._cell = self._head = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self._cls = a.get("class") or ""
            self.tables.setdefault(self._cls, [])
        elif tag == "tr" and self._cls is not None:
            self.tables[self._cls].append([])
        elif tag in ("td", "th") and self._cls is not None:
            self._cell = []
        elif tag in ("h2", "h3"):
            self._head = []
        elif tag == "br" and self._cell is not None:
            self._cell.append(" ")

    def handle_endtag(self, tag):
        if tag == "table":
            self._cls = None
        elif tag in ("td", "th") and self._cell is not None:
            self.tables[self._cls][-1].append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag in ("h2", "h3") and self._head is not None:
            self.headings.append(" ".join("".join(self._head).split()))
            self._head = None

    def handle_data(self, data):
        for part in (self._cell, self._head):
            if part is not None:
                part.append(data)


def parse(path: Path) -> _Tables:
    p = _Tables()
    p.feed(path.read_text(encoding="utf-8"))
    return p


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    run = write_fake_run(tmp_path_factory.mktemp("suite") / "run", EXTRACTORS)
    write_fake_eval(run, {name: n for name, _, n in EXTRACTORS})
    write_fake_peers(run)
    write_report(run)
    return run


def test_the_index_shows_the_suites_table_with_baselines_intervals_and_verdicts(run):
    page = parse(run / "report" / "index.html")
    assert "Evaluation suite" in page.headings
    # the description pass's own table stays under it: the best single concepts next to the random control's
    quality = "Quality of single concepts (the description pass's probes)"
    assert quality in page.headings and page.headings.index(quality) > page.headings.index("Evaluation suite")
    assert [h for h in page.headings if h.startswith(("probing", "reconstruction"))] == [
        f"probing toy at {SITE}", f"reconstruction at {SITE}"]
    rows = [r for r in page.tables["suite"] if r[0] != "set"]
    expected = []
    for part in ("probing toy", "reconstruction"):
        for name, _, n in sorted(EXTRACTORS):  # the file's order: sets in name order within a part
            expected += [[name, ln.metric, *_shown(ln)] for p, ln in fake_lines({name: n}) if p == part and ln.concept is None]
    assert sorted(rows) == sorted(expected)
    html = (run / "report" / "index.html").read_text()
    assert html.count('<figcaption class="legend">Each figure of') == 1  # one legend under both parts' tables


def _shown(ln: Line) -> list[str]:
    """What a suite row shows for `ln`: value [interval], matched control, other baselines, verdict, note."""
    def est(e):
        return f"{e.value:.4f}" + ("" if math.isnan(e.low) else f" [{e.low:.4f}, {e.high:.4f}]")
    verdict = {0.91: "wins", 0.72: "overlaps", 0.5: "loses", 0.25: "", 0.66: "wins"}[ln.value.value]  # by hand
    return [est(ln.value), f"{ln.baselines[0][0]} {est(ln.baselines[0][1])}",
            " ".join(f"{name} {est(e)}" for name, e in ln.baselines[1:]), verdict, ln.note]


def test_a_concept_page_shows_its_own_scores_next_to_their_controls(run):
    page = parse(run / "report" / "concepts" / "topk" / "1.html")
    assert "Evaluation suite: this concept's scores" in page.headings
    (line,) = [ln for _, ln in fake_lines({"topk": 12}) if ln.concept == 1]
    assert page.tables["suite"] == [["part", "metric", "value [95% CI]", "matched control [95% CI]",
                                     "other baselines [95% CI]", "vs control", "note"],
                                    ["probing toy", line.metric, "0.6600 [0.6100, 0.7000]", "random 12 dirs, best 1 0.5500 [0.5000, 0.6000]",
                                     "diff-of-means 0.8000 [0.7800, 0.8300]", "wins", "rank 1"]]
    other = (run / "report" / "concepts" / "topk" / "2.html").read_text()
    assert "suite" not in parse(run / "report" / "concepts" / "topk" / "2.html").tables
    assert "scored alone only the 5 concepts of topk with the largest mean difference" in other


def test_the_peers_table_and_the_manifest(run):
    page = parse(run / "report" / "index.html")
    assert page.tables["peers"] == [["trainer", "tokens", "step time (s)", "FVU", "L0", "CE loss recovered"],
                                    ["ours-topk", "49,152", "12.5", "0.21", "32", "0.93"],
                                    ["sparsify-topk", "49,152", "20", "0.24", "32", ""]]
    assert "ours-topk vs sparsify goal met" in (run / "report" / "index.html").read_text()
    listed = json.loads((run / "report" / MANIFEST).read_text())["files"]
    assert sorted(listed) == sorted(p.relative_to(run / "report").as_posix() for p in (run / "report").rglob("*")
                                    if p.is_file() and p.name != MANIFEST)


def test_without_eval_json_the_index_keeps_the_quality_table(tmp_path):
    run = write_fake_run(tmp_path / "run", EXTRACTORS)
    write_report(run)
    page = parse(run / "report" / "index.html")
    assert "Quality" in page.headings and "Evaluation suite" not in page.headings and "suite" not in page.tables
    assert "Evaluation suite" not in (run / "report" / "concepts" / "topk" / "1.html").read_text()


def test_figures_of_a_set_refitted_since_are_left_out(tmp_path):
    run = write_fake_run(tmp_path / "run", EXTRACTORS)
    write_fake_eval(run, {"topk": 12, "kmeans": 8})
    cs = ConceptSet.load(run / "concepts" / "kmeans")
    ConceptSet(cs.directions * 2, cs.site, method=cs.method, model=cs.model).save(run / "concepts" / "kmeans")
    write_report(run)
    html = (run / "report" / "index.html").read_text()
    assert "kmeans: refitted since the suite ran" in html
    assert {r[0] for r in parse(run / "report" / "index.html").tables["suite"][1:] if r[0] != "set"} == {"topk"}
    assert "suite" not in parse(run / "report" / "concepts" / "kmeans" / "1.html").tables


def test_every_string_from_the_files_is_escaped(tmp_path):
    attack = "<img src=x onerror=alert(1)>\u202e"
    run = write_fake_run(tmp_path / "run", EXTRACTORS)
    write_fake_eval(run, {"topk": 12}, text=attack, model=attack)
    write_fake_peers(run, text=attack)
    write_report(run)
    for page in ("index.html", "concepts/topk/1.html"):
        html = (run / "report" / page).read_text()
        assert "<img" not in html and "\u202e" not in html, page
        assert "&lt;img src=x onerror=alert(1)&gt;\u27e8U+202E\u27e9" in html, page


def test_a_malformed_eval_json_stops_the_report_in_one_line(tmp_path):
    run = write_fake_run(tmp_path / "run", EXTRACTORS)
    write_fake_eval(run, {"topk": 12})
    data = json.loads((run / "eval.json").read_text())
    data["lines"][0]["value"] = ["0.5", 0.4, 0.6]
    (run / "eval.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=re.escape("eval.json: lines[0]: value must be an integer or a number")):
        write_report(run)
