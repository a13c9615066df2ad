"""Write the static report of a run folder: `RUN/report/index.html` and the pages it links.

    summary = write_report("runs/demo")         # ReportSummary(path, pages, bytes, seconds)

Layout of `report/`: `index.html`, `matches.html`, `concepts/<NAME>/<i>.html`,
`hierarchy/<NAME>.html` (when the run has `hierarchy/<NAME>.json`), and `static/`
(style.css, atlas.js, atlas-data.js). Every link is relative, nothing is fetched: the folder
opens from file:// and can be copied anywhere. The report is written into a new private folder
beside `out` and swapped in at the end, so an interrupted run leaves the previous report intact;
`out` must be new, empty or an earlier report (see `report.output`: nothing else is removed).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import NamedTuple

from conceptlens.report.assets import CSS, JS
from conceptlens.report.atlas import Atlas
from conceptlens.report.concept_page import concept_page, top_tokens
from conceptlens.report.evaluation import Suite, concept_scores
from conceptlens.report.hierarchy_page import dag_from_json, family, hierarchy_page
from conceptlens.report.index_page import index_page, write_data_js
from conceptlens.report.matching import match_extractors, partners
from conceptlens.report.output import check_out, commit, discard, new_staging
from conceptlens.report.pairs_page import matches_page
from conceptlens.runlock import locks_first_argument


class ReportSummary(NamedTuple):
    path: Path
    """the report's index.html"""
    pages: int
    bytes: int
    seconds: float


def _labels(atlas: Atlas) -> dict[str, list[str]]:
    """A short label per concept: its most frequent activating tokens."""
    return {ex.name: [", ".join(top_tokens(ctx)) for ctx in ex.contexts()] for ex in atlas.extractors}


@locks_first_argument("report")  # one writer of the run folder at a time
def write_report(run: str | os.PathLike, out: str | os.PathLike | None = None, *, progress: bool = False) -> ReportSummary:
    """Render the report of `run` into `out` (default `run/report`); see the module docstring."""
    start = time.perf_counter()
    atlas = Atlas.load(run)
    out = Path(out) if out is not None else atlas.run / "report"
    owned = check_out(atlas.run, out)
    tmp = new_staging(out)
    try:
        pages = _write_pages(atlas, tmp, progress)
        size = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
        commit(tmp, out, owned, atlas.run)
    except BaseException:
        discard(tmp)
        raise
    return ReportSummary(out / "index.html", pages, size, time.perf_counter() - start)


def _write_pages(atlas: Atlas, tmp: Path, progress: bool) -> int:
    """Every page and static file of the report, written under `tmp`; the number of pages."""
    (tmp / "static").mkdir(parents=True)
    labels = _labels(atlas)
    pairs = match_extractors(atlas.extractors)
    families = {name: family(dag_from_json(data)) for name, data in atlas.hierarchies.items()}
    suite = Suite.of(atlas)
    scores = suite.by_concept() if suite is not None else {}
    pages = 0
    for ex in atlas.extractors:
        folder = tmp / "concepts" / ex.name
        folder.mkdir(parents=True)
        near, steering = partners(pairs, ex.name), ex.steering()
        contexts = ex.contexts()
        if progress:
            from tqdm.auto import tqdm

            contexts = tqdm(contexts, total=ex.n, desc=f"report {ex.name}", unit="concept")
        note = suite.note(ex.name) if suite is not None else ""
        for i, ctx in enumerate(contexts):
            html = concept_page(ex, i, ctx, labels, near, steering.get(i), families.get(ex.name),
                                concept_scores(scores.get((ex.name, i), ()), note))
            (folder / f"{i}.html").write_text(html, encoding="utf-8")
            pages += 1
    data_js, shown = write_data_js(atlas, labels)
    files = {"static/style.css": CSS, "static/atlas.js": JS, "static/atlas-data.js": data_js,
             "index.html": index_page(atlas, shown, suite),
             "matches.html": matches_page(pairs, {ex.name: ex.site for ex in atlas.extractors}, labels)}
    for name, data in atlas.hierarchies.items():
        files[f"hierarchy/{name}.html"] = hierarchy_page(name, data, labels[name])
    for rel, text in files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(text, encoding="utf-8")
    return pages + sum(rel.endswith(".html") for rel in files)
