"""One page per concept: top contexts, histogram, the suite's scores, promoted tokens, neighbours, steering."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Sequence

import numpy as np

from conceptlens.report.atlas import ExtractorView
from conceptlens.report.histogram import histogram_svg
from conceptlens.report.html import context_html, esc, label_token, num, page, pct, table, token_text
from conceptlens.report.legends import LEGENDS, figure
from conceptlens.report.quality import duplicates

ROOT = "../../"


def top_tokens(contexts: Sequence[dict[str, Any]], k: int = 4) -> list[str]:
    """The most frequent activating (centre) tokens of the top contexts, strongest first on ties."""
    centres = [label_token(c["tokens"][c["center"]])
               for c in contexts if 0 <= c.get("center", -1) < len(c.get("tokens", []))]
    counts = Counter(centres)
    first = {t: i for i, t in reversed(list(enumerate(centres)))}
    return sorted(counts, key=lambda t: (-counts[t], first[t]))[:k]


def first_tokens(contexts_per_concept: Any) -> list[str | None]:
    """Each concept's first top token (the centre of its strongest context), None without contexts."""
    out: list[str | None] = []
    for contexts in contexts_per_concept:
        c = contexts[0] if contexts else None
        if c is not None and 0 <= c.get("center", -1) < len(c.get("tokens", [])):
            out.append(label_token(c["tokens"][c["center"]]))
        else:
            out.append(None)
    return out


def concept_href(name: str, i: int, from_concept_page: bool = True) -> str:
    return f"../{name}/{i}.html" if from_concept_page else f"concepts/{name}/{i}.html"


def concept_link(name: str, i: int, labels: dict[str, list[str]], extra: str = "") -> str:
    label = labels.get(name, [])
    text = (label[i] or "no contexts") if i < len(label) else ""  # a label is empty only without contexts
    return (f'<a href="{esc(concept_href(name, i))}">{esc(name)} #{i}</a> '
            f'<span class="muted">{esc(text)}{extra}</span>')


def _stats_block(ex: ExtractorView, i: int) -> str:
    s = ex.stats
    rows = [("frequency (active: activation > 0)", pct(s["frequency"][i]) if "frequency" in s else ""),
            ("assigned", pct(s["assigned"][i]) if "assigned" in s else ""),
            ("mean activation", num(s["mean_activation"][i]) if "mean_activation" in s else ""),
            ("max activation", num(s["max_activation"][i]) if "max_activation" in s else "")]
    head = (f'<p class="meta">{esc(ex.method)} at <code>{esc(ex.site)}</code>, concept {i} of {ex.n}; '
            f'activation: {esc(ex.meta.get("activation", "?"))}</p>')
    dup = duplicates(ex)[i]
    if dup is not None:
        head += (f'<p class="banner">Near-duplicate of <a href="{esc(concept_href(ex.name, dup[0]))}">{esc(ex.name)} '
                 f'#{dup[0]}</a> (cosine {dup[1]:.6f} &gt; 0.99).</p>')
    html = table(["statistic", "value"], [(k, v) for k, v in rows if v], [False, True])
    return head + figure(html, LEGENDS["frequency"] + (" " + LEGENDS["assigned"] if "assigned" in s else ""))


def _probe_block(ex: ExtractorView, i: int) -> str:
    if "probe_loss" not in ex.stats or not ex.labels or not np.isfinite(ex.stats["probe_loss"][i]).any():
        return ""
    base = ex.meta.get("base_rate_entropy") or {}
    rows = []
    for c, label in enumerate(ex.labels):
        loss, b = float(ex.stats["probe_loss"][i, c]), base.get(label)
        b = None if b is None or not math.isfinite(b) else float(b)
        better = b is not None and loss < b
        rows.append((esc(label), f'<span class="{"good" if better else ""}">{num(loss)}</span>', num(b),
                     num(b - loss) if b is not None else ""))
    html = table(["class", "probe log-loss", "base-rate entropy", "gain (nats)"], rows, [False, True, True, True])
    return "<h2>Probe loss per class</h2>" + figure(html, LEGENDS["probe"])


def _tokens_block(ex: ExtractorView, i: int) -> str:
    if not ex.tokens:
        return ""
    out = []
    for key, logit_key in (("promoted", "promoted_logit"), ("suppressed", "suppressed_logit")):
        toks = (ex.tokens.get(key) or [[]] * ex.n)[i]
        logits = ex.stats.get(logit_key)
        spans = " ".join(f'<span class="tok" title="{num(logits[i, j]) if logits is not None else ""}">'
                         f'{esc(token_text(t))}</span>' for j, t in enumerate(toks))
        out.append(f"<div><h2>{key.capitalize()} tokens</h2>{spans}</div>")
    return figure('<div class="grid">' + "".join(out) + "</div>", LEGENDS["tokens"])


def _neighbours_block(ex: ExtractorView, i: int, labels: dict[str, list[str]],
                      partners: Sequence[tuple[str, np.ndarray, np.ndarray]]) -> str:
    cols = []
    coact = "Pearson" if ex.meta.get("coact_kind") == "pearson" else "Jaccard"
    for key, score_key, title in (("nearest_direction", "nearest_direction_cos", "Nearest by direction (cosine)"),
                                  ("nearest_coact", "nearest_coact_score", f"Nearest by co-activation ({coact})")):
        if key in ex.stats:
            items = [concept_link(ex.name, int(j), labels, f" ({num(s, 3)})")
                     for j, s in zip(ex.stats[key][i], ex.stats[score_key][i])
                     if 0 <= j < ex.n and (key != "nearest_coact" or s > 0)]  # a zero score: never together
            listed = "".join(f"<li>{x}</li>" for x in items) or f"<li>none with a {coact} score above 0</li>"
            cols.append(f"<div><h2>{title}</h2><ol>{listed}</ol></div>")
    if partners:
        items = [concept_link(other, int(best[i]), labels, f" (cosine {num(cos[i], 3)})") for other, best, cos in partners]
        cols.append('<div><h2>Closest in other extractors</h2><ul>' + "".join(f"<li>{x}</li>" for x in items)
                    + '</ul><p><a href="../../matches.html">all matches</a></p></div>')
    return figure('<div class="grid">' + "".join(cols) + "</div>", LEGENDS["neighbours"]) if cols else ""


def _contexts_block(contexts: Sequence[dict[str, Any]]) -> str:
    if not contexts:
        return "<h2>Top contexts</h2><p class='muted'>none recorded</p>"
    scale = max((abs(float(a)) for c in contexts for a in c.get("acts", [])), default=0.0)
    lines = [f'<div class="ctx"><span class="v">{num(c["value"], 3)}</span>'
             f'{context_html(c["tokens"], c["acts"], c["center"], scale)}</div>' for c in contexts]
    return f"<h2>Top {len(contexts)} contexts</h2>" + figure("\n".join(lines), LEGENDS["contexts"])


def _steering_block(sample: dict[str, Any] | None) -> str:
    if not sample:
        return ""
    rows = [(f'{num(s["alpha"], 3)} &times; {esc(s.get("scale", ""))}', esc(s["text"])) for s in sample["samples"]]
    value = sample.get("norm", sample.get("site_norm"))  # "site_norm": descriptions written before robust_norm
    norm = f' (typical residual norm {num(value)})' if value else ""
    if sample.get("chosen_alpha") is not None:
        norm += f'; largest alpha within the fluency budget: {num(sample["chosen_alpha"], 3)}'
    elif "chosen_alpha" in sample:
        norm += "; no alpha stays within the fluency budget"
    return (f'<h2>Steering</h2><p>Prompt: <code>{esc(sample["prompt"])}</code>{esc(norm)}</p>'
            + figure(table(["alpha", "continuation"], rows, attrs=' class="steer"'),
                     LEGENDS["steering"].format(where=STEERED_AT.get(str(sample.get("positions")), ""))))


STEERED_AT = {"all": " at every position", "generated": " at the generated tokens only (the prompt read unsteered)"}
"""The steering legend's positions, by a sample's "positions" (none said in samples written before it)."""


def _hierarchy_block(name: str, i: int, hierarchy: dict[str, list[int]] | None, labels: dict[str, list[str]]) -> str:
    if hierarchy is None:
        return ""
    parents, children = hierarchy.get(f"p{i}", []), hierarchy.get(f"c{i}", [])
    if not parents and not children:
        return ""
    fmt = lambda js: ", ".join(concept_link(name, j, labels) for j in js) or "none"  # noqa: E731
    return (f'<h2>Hierarchy</h2><p>parents: {fmt(parents)}</p><p>children: {fmt(children)}</p>'
            f'<p><a href="../../hierarchy/{esc(name)}.html">the whole hierarchy</a></p>')


def concept_page(ex: ExtractorView, i: int, contexts: Sequence[dict[str, Any]], labels: dict[str, list[str]],
                 partners: Sequence[tuple[str, np.ndarray, np.ndarray]], steering: dict[str, Any] | None,
                 hierarchy: dict[str, list[int]] | None = None, scores: str = "") -> str:
    """The HTML of concept `i` of `ex` (written to `concepts/<NAME>/<i>.html`); `scores`: its block of
    the evaluation suite's figures (`evaluation.concept_scores`)."""
    s = ex.stats
    hist = ""
    if "hist_counts" in s and "hist_edges" in s:
        edges = s["hist_edges"][i] if s["hist_edges"].ndim == 2 else s["hist_edges"]
        svg = histogram_svg(edges, s["hist_counts"][i])
        legend = LEGENDS["histogram"] + (" " + LEGENDS["histogram zero"] if "stroke-dasharray" in svg else "")
        hist = "<h2>Activation histogram</h2>" + figure(svg, legend)
    nav = [("index.html", "atlas index"), ("matches.html", "matches")]
    nav += [(f"concepts/{ex.name}/{j}.html", label) for j, label in ((i - 1, "previous"), (i + 1, "next")) if 0 <= j < ex.n]
    label = labels.get(ex.name, [""] * ex.n)[i]
    body = (f'<div class="grid"><div>{_stats_block(ex, i)}</div><div>{hist}</div></div>' + _contexts_block(contexts)
            + scores + _probe_block(ex, i) + _tokens_block(ex, i) + _neighbours_block(ex, i, labels, partners)
            + _hierarchy_block(ex.name, i, hierarchy, labels) + _steering_block(steering))
    return page(f"{ex.name} #{i}" + (f" \u2014 {label}" if label else ""), body, ROOT, nav)
