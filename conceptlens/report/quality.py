"""The atlas's quality table, computed from the run folder itself (so CLI-made atlases have one too).

    html = quality_block(atlas, heads)     # heads: name -> each concept's first top token

One row per concept set; control rows (random directions described alongside) give the best
probe of as many random directions as the set has concepts (the first n of the control:
independent draws, so any n of them are n random directions); the baseline row is the
base-rate entropy. FVU / L0 come from the fit's own statistics (`fit_report.json`).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Sequence

import numpy as np
import torch

from conceptlens.metrics.quality import effective_rank
from conceptlens.report.atlas import Atlas, ExtractorView
from conceptlens.report.html import esc, num, table
from conceptlens.report.legends import DUPLICATE_COSINE, LEGENDS, figure


def duplicates(ex: ExtractorView) -> list[tuple[int, float] | None]:
    """Per concept: (its nearest other concept, cosine) when the cosine exceeds DUPLICATE_COSINE, else None."""
    near, cos = ex.stats.get("nearest_direction"), ex.stats.get("nearest_direction_cos")
    if near is None or cos is None or near.shape[1] == 0:
        return [None] * ex.n
    return [(int(near[i, 0]), float(cos[i, 0])) if cos[i, 0] > DUPLICATE_COSINE else None for i in range(ex.n)]


def head_token(heads: Sequence[str | None]) -> tuple[str, int] | None:
    """The token that is the first top token of the most concepts, and how many."""
    counts = Counter(h for h in heads if h is not None)
    return counts.most_common(1)[0] if counts else None


def best_probe(ex: ExtractorView, n: int | None = None) -> dict[str, float]:
    """class -> lowest probe loss over the set's first n concepts (all when n is None)."""
    loss = ex.stats.get("probe_loss")
    if loss is None or not ex.labels:
        return {}
    loss = loss[:n].astype(np.float64)
    return {c: float(np.nanmin(loss[:, j])) for j, c in enumerate(ex.labels) if np.isfinite(loss[:, j]).any()}


def _rank(ex: ExtractorView, n: int | None = None) -> float | None:
    return None if ex.directions is None else effective_rank(torch.from_numpy(ex.directions[:n]), unit=True)


def quality_rows(atlas: Atlas, heads: dict[str, list[str | None]]) -> list[tuple[str, dict[str, Any]]]:
    """(label, metric -> value) per set, per matched control and the baseline."""
    report = atlas.fit_report or {}
    fit = report.get("stats") or report.get("extractors") or {}  # "extractors": run folders before the rename
    rows = []
    for ex in atlas.extractors:
        row: dict[str, Any] = {"concepts": ex.n, "effective rank": _rank(ex),
                               "near-duplicates": sum(d is not None for d in duplicates(ex))}
        top = head_token(heads.get(ex.name, []))
        row["top token"] = f"{top[0]!r} heads {top[1]}/{ex.n}" if top else None
        row |= {f"probe {c}": v for c, v in best_probe(ex).items()}
        mean = (fit.get(ex.name) or {}).get("mean") if isinstance(fit.get(ex.name), dict) else None
        if isinstance(mean, dict):
            row |= {"FVU": mean.get("fvu"), "L0": mean.get("l0")}
        rows.append((ex.name, row))
    for n in sorted({ex.n for ex in atlas.extractors}):
        for control in atlas.controls:
            sites = [ex.name for ex in atlas.extractors if ex.n == n and ex.site == control.site]
            if sites and control.n >= n:
                row = {"concepts": n, "effective rank": _rank(control, n)}
                row |= {f"probe {c}": v for c, v in best_probe(control, n).items()}
                rows.append((f"control: {control.name}, best of {n} (for {', '.join(sites)})", row))
    base = atlas.extractors[0].meta.get("base_rate_entropy") or {}
    baseline = {f"probe {c}": v for c, v in base.items() if v is not None}
    if baseline or any("FVU" in r for _, r in rows):
        rows.append(("baseline: base-rate entropy; FVU of the mean", baseline | {"FVU": 1.0}))
    return rows


def quality_block(atlas: Atlas, heads: dict[str, list[str | None]], after_suite: bool = False) -> str:
    """The Quality section of the index: the table and its legend (`after_suite`: titled as the
    description pass's table, shown under the evaluation suite's)."""
    rows = quality_rows(atlas, heads)
    cols = list(dict.fromkeys(k for _, r in rows for k in r))
    cells = []
    for label, r in rows:
        kind = "control" if label.startswith("control:") else "baseline" if label.startswith("baseline") else ""
        name = f'<span class="{kind}">{esc(label)}</span>' if kind else esc(label)
        cells.append((name, *(_cell(r.get(c)) for c in cols)))
    html = table(["set", *map(esc, cols)], cells, [False] + [True] * len(cols), attrs=' class="quality"')
    title = "Quality of single concepts (the description pass's probes)" if after_suite else "Quality"
    return f"<h2>{title}</h2>" + figure(html, LEGENDS["quality"])


def _cell(v: Any) -> str:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return num(v) if not (isinstance(v, float) and math.isnan(v)) else ""
    return "" if v is None else esc(v)
