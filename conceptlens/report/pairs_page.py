"""The matches page: which concept of one extractor is which of another at the same site."""

from __future__ import annotations

import numpy as np

from conceptlens.report.html import esc, num, page, table
from conceptlens.report.matching import Matching


def _link(name: str, i: int, labels: dict[str, list[str]]) -> str:
    return (f'<a href="concepts/{esc(name)}/{i}.html">{esc(name)} #{i}</a> '
            f'<span class="muted">{esc(labels[name][i])}</span>')


def matches_page(pairs: dict[tuple[str, str], Matching], sites: dict[str, str], labels: dict[str, list[str]]) -> str:
    """Summary of every pair, then each pair's one-to-one matches sorted by cosine."""
    if not pairs:
        body = "<p>No two extractors with saved directions share a site, so there is nothing to match.</p>"
        return page("Matches across extractors", body, "", [("index.html", "index")])
    summary, sections = [], []
    for (a, b), m in pairs.items():
        anchor = f"{a}__{b}"
        summary.append((f'<a href="#{esc(anchor)}">{esc(a)} &harr; {esc(b)}</a>', f"<code>{esc(sites[a])}</code>",
                        str(len(m.cos)), num(float(np.mean(m.cos)), 3),
                        *(str(int((m.cos > t).sum())) for t in (0.9, 0.7, 0.5))))
        rows = [(_link(a, int(i), labels), _link(b, int(j), labels), num(c, 3)) for i, j, c in zip(m.rows, m.cols, m.cos)]
        sections.append(f'<h2 id="{esc(anchor)}">{esc(a)} &harr; {esc(b)}</h2>'
                        + table([esc(a), esc(b), "cosine"], rows, [False, False, True]))
    body = ("<p>One-to-one matching of unit directions by cosine (Hungarian assignment maximising the summed "
            "cosine). Each concept page also links its best partner in every other extractor.</p>"
            + table(["pair", "site", "matched", "mean cosine", "&gt; 0.9", "&gt; 0.7", "&gt; 0.5"], summary,
                    [False, False, True, True, True, True, True])
            + "".join(sections))
    return page("Matches across extractors", body, "", [("index.html", "index")])
