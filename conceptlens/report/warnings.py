"""What the index says before anything else: a token that heads many concepts, a site whose
variance a few large-norm tokens carry, and the per-site table of token norms.

    banners(atlas, heads) + norms_block(atlas)
"""

from __future__ import annotations

from typing import Any

from conceptlens.report.atlas import Atlas
from conceptlens.report.html import esc, num, pct, table
from conceptlens.report.legends import HEADS_SHARE, LEGENDS, figure
from conceptlens.report.quality import head_token


def site_norms(atlas: Atlas) -> dict[str, dict[str, Any]]:
    """site -> the description pass's norm summary (the same for every set at the site)."""
    out: dict[str, dict[str, Any]] = {}
    for ex in atlas.extractors + atlas.controls:
        if isinstance(ex.meta.get("norms"), dict):
            out.setdefault(ex.site, ex.meta["norms"])
    return out


def _largest(norms: dict[str, Any]) -> str:
    return ", ".join(f"{t!r} \u00d7{c}" for t, c in norms.get("largest") or [])


def banners(atlas: Atlas, heads: dict[str, list[str | None]]) -> str:
    """Warnings shown first on the index (empty when nothing is wrong)."""
    out = []
    for ex in atlas.extractors:
        top = head_token(heads.get(ex.name, []))
        if top and top[1] > HEADS_SHARE * ex.n:
            out.append(f"{top[0]!r} is the first top token of {top[1]} of the {ex.n} concepts of {ex.name}: "
                       "those concepts may describe that one token (or its norm) rather than a concept.")
    for site, norms in site_norms(atlas).items():
        if norms.get("dominated"):
            out.append(f"At {site} the {pct(norms.get('top_fraction'))} largest-norm described tokens carry "
                       f"{pct(norms.get('top_share'))} of the variance (largest: {_largest(norms)}): a fit there "
                       "describes mostly those tokens.")
    return "".join(f'<p class="banner" role="alert">{esc(text)}</p>' for text in out)


def norms_block(atlas: Atlas) -> str:
    """Per site: rows filtered, the variance share of the largest-norm tokens and which they are."""
    rows = []
    for site, n in site_norms(atlas).items():
        f = n.get("filtered") or {}
        bar = f" (&gt; {num(n['filter_ratio'], 3)}x median)" if n.get("filter_ratio") else ""
        rows.append((f"<code>{esc(site)}</code>", f"{int(f.get('seen', 0)):,}", f"{int(f.get('norm_outlier', 0)):,}{bar}",
                     num(n.get("median_norm")), num(n.get("max_norm_ratio"), 3), pct(n.get("top_share")),
                     esc(_largest(n))))
    if not rows:
        return ""
    html = table(["site", "rows", "dropped as norm outliers", "median norm", "max / median",
                  "variance share of the largest-norm 1%", "largest-norm tokens"], rows,
                 [False, True, True, True, True, True, False])
    return "<h2>Token norms</h2>" + figure(html, LEGENDS["norms"])
