"""The index: run summary, the evaluation suite's table (else the quality table), a 2-D map and a
table of every concept.

The rows live once in `static/atlas-data.js`; the page's script renders, sorts and filters them.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from conceptlens.report.atlas import Atlas, ExtractorView
from conceptlens.report.concept_page import first_tokens
from conceptlens.report.evaluation import Suite
from conceptlens.report.html import esc, label_token, page, table
from conceptlens.report.legends import LEGENDS, figure
from conceptlens.report.quality import duplicates, quality_block
from conceptlens.report.warnings import banners, norms_block

COLUMNS = ["ex", "concept", "frequency", "mean_activation", "max_activation", "tokens", "promoted",
           "best_class", "best_loss", "base_rate", "gain", "x", "y", "assigned", "dup"]
# (column, kind, header) shown in the table after extractor and concept
SHOWN = [("frequency", "pct", "frequency"), ("assigned", "pct", "assigned"), ("mean_activation", "num", "mean act."),
         ("max_activation", "num", "max act."), ("tokens", "text", "top tokens"),
         ("promoted", "text", "promoted tokens"), ("best_class", "text", "best class"),
         ("best_loss", "num", "probe loss"), ("base_rate", "num", "base rate"), ("gain", "num", "gain (nats)"),
         ("dup", "text", "dup")]


def map_xy(ex: ExtractorView) -> np.ndarray | None:
    """(n, 2) map coordinates: the description's `map_xy`, else PCA of the unit directions."""
    if "map_xy" in ex.stats:
        return ex.stats["map_xy"].astype(np.float64)
    if ex.directions is None or ex.n < 2:
        return None
    centred = ex.directions - ex.directions.mean(0)
    _, _, vt = np.linalg.svd(centred.astype(np.float64), full_matrices=False)
    return centred @ vt[:2].T


def _clean(v: Any, digits: int = 9) -> Any:
    """A JSON-ready value for the index's rows: floats to 9 significant digits, which carry a float32
    statistic exactly, so the page's one rounding (atlas.js's `fmt`) shows what the concept pages show
    (at 5 digits, rounding twice changed the last shown digit of 199 of 6,400 demo figures)."""
    if isinstance(v, (float, np.floating)):
        return float(f"{float(v):.{digits}g}") if math.isfinite(float(v)) else None
    return v


def extractor_rows(k: int, ex: ExtractorView, labels: Sequence[str]) -> list[list[Any]]:
    """The index rows of one extractor, in `COLUMNS` order."""
    s, n = ex.stats, ex.n
    xy = map_xy(ex)
    promoted = (ex.tokens or {}).get("promoted")
    base = {c: math.nan if v is None else float(v) for c, v in (ex.meta.get("base_rate_entropy") or {}).items()}
    probe = s.get("probe_loss")
    dups = duplicates(ex)
    rows = []
    for i in range(n):
        best: list[str | float | None] = [None, None, None, None]  # class, probe loss, base rate, gain
        if probe is not None and ex.labels:
            gains = [base.get(c, math.nan) - float(probe[i, j]) for j, c in enumerate(ex.labels)]
            if not all(math.isnan(g) for g in gains):
                j = int(np.nanargmax(gains))
                best = [ex.labels[j], probe[i, j], base.get(ex.labels[j]), gains[j]]
        dup = dups[i]
        rows.append([_clean(v) for v in [
            k, i, *(s[key][i] if key in s else None for key in ("frequency", "mean_activation", "max_activation")),
            labels[i], " ".join(label_token(t) for t in promoted[i][:5]) if promoted else None, *best,
            *(xy[i] if xy is not None else (None, None)), s["assigned"][i] if "assigned" in s else None,
            f"#{dup[0]} ({dup[1]:.4f})" if dup else None]])
    return rows


def write_data_js(atlas: Atlas, labels: dict[str, list[str]]) -> tuple[str, list[str]]:
    """The text of `static/atlas-data.js` (every concept row of every extractor) and the
    columns that have values (the table shows only those)."""
    classes = sorted({c for ex in atlas.extractors for c in ex.labels or []})
    rows = [r for k, ex in enumerate(atlas.extractors) for r in extractor_rows(k, ex, labels[ex.name])]
    present = {c for c in COLUMNS if any(r[COLUMNS.index(c)] is not None for r in rows)}
    shown = [[c, kind] for c, kind, _ in SHOWN if c in present]
    data = {"columns": COLUMNS, "shown": shown, "labels": classes or None, "rows": rows,
            "extractors": [{"name": ex.name, "site": ex.site, "method": ex.method, "n": ex.n} for ex in atlas.extractors]}
    text = "window.ATLAS_DATA = " + esc(data, "js") + ";\n"
    return text, [c for c, _ in shown]


def _run_block(atlas: Atlas) -> str:
    fr = atlas.fit_report or {}
    meta = atlas.extractors[0].meta
    parts = [f"model <code>{esc(meta.get('model') or atlas.config.get('model', '?'))}</code>"]
    if fr:
        parts.append(f"fit on {fr.get('tokens', 0):,} tokens in {fr.get('documents', 0):,} documents "
                     f"({float(fr.get('seconds') or 0):.1f} s)")
    parts.append(f"described on {int(meta.get('tokens') or 0):,} kept tokens of {int(meta.get('documents') or 0):,} "
                 "documents (each one's first token and norm outliers left out)")
    return f'<p class="meta">{"; ".join(parts)}</p>'


def _extractors_block(atlas: Atlas) -> str:
    rows = []
    for ex in atlas.extractors:
        h = f'<a href="hierarchy/{esc(ex.name)}.html">hierarchy</a>' if ex.name in atlas.hierarchies else ""
        fed = "" if ex.fit_tokens is None else f"{ex.fit_tokens:,}"
        frequency = ex.stats.get("frequency")
        silent = "" if frequency is None else f"{int((np.asarray(frequency) == 0).sum()):,}"
        rows.append((esc(ex.name), f"<code>{esc(ex.site)}</code>", esc(ex.method), str(ex.n), silent, fed,
                     esc(ex.meta.get("activation", "")),
                     (f'<a class="first" href="concepts/{esc(ex.name)}/0.html">first concept</a> ' if ex.n else
                      "no concepts ") + h))  # a set of none has no page to link
    html = table(["name", "site", "method", "concepts", "never active", "fit tokens", "activation", ""], rows,
                 [False, False, False, True, True, True, False, False])
    return "<h2>Extractors</h2>" + figure(html, LEGENDS["extractors"] + " " + LEGENDS["activation"])


def index_page(atlas: Atlas, shown: Sequence[str], suite: Suite | None = None) -> str:
    options = "".join(f'<option value="{esc(ex.name)}">{esc(ex.name)}</option>' for ex in atlas.extractors)
    head = "".join(f'<th class="sort" data-col="{c}" data-kind="{kind}">{esc(h)}</th>' for c, kind, h in SHOWN if c in shown)
    heads = {ex.name: first_tokens(ex.contexts()) for ex in atlas.extractors}
    concepts = (f'<div class="scroll"><table id="concepts"><thead><tr><th>extractor</th><th class="sort num" '
                f'data-col="concept" data-kind="num">#</th>{head}</tr></thead><tbody></tbody></table></div>')
    # the suite's tables, then the describe pass's own: its best single concepts next to the random control's
    quality = (suite.block() if suite is not None else "") + quality_block(atlas, heads, suite is not None)
    body = (banners(atlas, heads) + _run_block(atlas) + _extractors_block(atlas) + quality
            + norms_block(atlas)
            + f'<h2>Map of the directions</h2><div class="controls"><label>extractor <select id="map-extractor">{options}'
            f'</select></label></div>'
            + figure('<svg id="map" width="720" height="420" role="img" aria-label="map of the concepts"></svg>',
                     LEGENDS["map"]).replace("</figcaption>", ' <span id="map-classes"></span></figcaption>')
            + f'<h2>Concepts</h2><div class="controls"><input id="filter" type="search" placeholder="filter: tokens, class, #id">'
            f'<label>extractor <select id="extractor"><option value="">all</option>{options}</select></label>'
            f'<span id="count" class="muted"></span></div>'
            f'<noscript><p>The concept table needs JavaScript; every concept page is under concepts/.</p></noscript>'
            + figure(concepts, " ".join(LEGENDS[k] for k in ("frequency", "assigned", "concepts")))
            + f'<p class="pager"><button id="more">show more</button></p>'
            f'<script src="static/atlas-data.js"></script><script src="static/atlas.js"></script>')
    nav = [("index.html", "index"), ("matches.html", "matches")]
    nav += [(f"hierarchy/{name}.html", f"hierarchy: {name}") for name in atlas.hierarchies]
    return page(f"Concept atlas: {atlas.run.resolve().name or atlas.run.resolve()}", body, "", nav)  # `report .` too
