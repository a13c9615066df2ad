"""Write the static report of a run folder: `RUN/report/index.html` and the pages it links.

    summary = write_report("runs/demo")         # ReportSummary(path, pages, bytes, seconds)

Layout of `report/`: `index.html`, `matches.html`, `concepts/<NAME>/<i>.html`,
`hierarchy/<NAME>.html` (when the run has `hierarchy/<NAME>.json`), and `static/`
(style.css, atlas.js, atlas-data.js). Every link is relative, nothing is fetched: the folder
opens from file:// and can be copied anywhere. The report is written next to the old one and
swapped in at the end, so an interrupted run leaves the previous report intact.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import NamedTuple

from conceptlens.report.assets import CSS, JS
from conceptlens.report.atlas import Atlas
from conceptlens.report.concept_page import concept_page, top_tokens
from conceptlens.report.hierarchy_page import dag_from_json, family, hierarchy_page
from conceptlens.report.index_page import index_page, write_data_js
from conceptlens.report.matching import match_extractors, partners
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
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "static").mkdir(parents=True)
    labels = _labels(atlas)
    pairs = match_extractors(atlas.extractors)
    families = {name: family(dag_from_json(data)) for name, data in atlas.hierarchies.items()}
    pages = 0
    for ex in atlas.extractors:
        folder = tmp / "concepts" / ex.name
        folder.mkdir(parents=True)
        near, steering = partners(pairs, ex.name), ex.steering()
        contexts = ex.contexts()
        if progress:
            from tqdm.auto import tqdm

            contexts = tqdm(contexts, total=ex.n, desc=f"report {ex.name}", unit="concept")
        for i, ctx in enumerate(contexts):
            html = concept_page(ex, i, ctx, labels, near, steering.get(i), families.get(ex.name))
            (folder / f"{i}.html").write_text(html, encoding="utf-8")
            pages += 1
    data_js, shown = write_data_js(atlas, labels)
    files = {"static/style.css": CSS, "static/atlas.js": JS, "static/atlas-data.js": data_js,
             "index.html": index_page(atlas, shown),
             "matches.html": matches_page(pairs, {ex.name: ex.site for ex in atlas.extractors}, labels)}
    for name, data in atlas.hierarchies.items():
        files[f"hierarchy/{name}.html"] = hierarchy_page(name, data, labels[name])
    for rel, text in files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(text, encoding="utf-8")
    pages += sum(rel.endswith(".html") for rel in files)
    size = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)
    return ReportSummary(out / "index.html", pages, size, time.perf_counter() - start)
