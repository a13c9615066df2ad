"""Small HTML and inline-SVG helpers for the report (strings in, strings out)."""

from __future__ import annotations

import json
import math
import re
from html import escape
from typing import Iterable, Literal, Sequence
from urllib.parse import quote

# explicit bidi controls (embeddings, overrides, isolates, marks): in a token they would reorder the
# rest of its line, numbers included; the pages show them as visible codes instead
BIDI = re.compile("[\u200e\u200f\u061c\u202a-\u202e\u2066-\u2069]")


def esc(value: object, context: Literal["html", "url", "js"] = "html") -> str:
    """`value` as text for its place in a page; the one escape of the report (atlas.js mirrors "html").

    html: element text or a quoted attribute (& < > " ' escaped, bidi controls shown as <U+202E>);
    url: a relative link path, each character outside [A-Za-z0-9_.~/-] percent-encoded, then as html;
    js: a JSON literal for a script (no '<', '>' or '&' in it, so no '</script>' can end it early).
    """
    if context == "url":
        return escape(quote(str(value), safe="/"), quote=True)
    if context == "js":
        text = json.dumps(value, separators=(",", ":"), allow_nan=False)
        return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return escape(BIDI.sub(lambda m: f"\u27e8U+{ord(m.group()):04X}\u27e9", str(value)), quote=True)


def num(value: float | None, digits: int = 4) -> str:
    """A number to `digits` significant figures; '' for None/nan/inf."""
    if value is None or not math.isfinite(float(value)):
        return ""
    return f"{float(value):.{digits}g}"


def pct(value: float | None) -> str:
    if value is None or not math.isfinite(float(value)):
        return ""
    return f"{100 * float(value):.3g}%"


def token_text(token: str) -> str:
    """A decoded token made visible: newlines as a return sign, tabs as an arrow."""
    return token.replace("\n", "\u21b5").replace("\t", "\u2192")


def label_token(token: str) -> str:
    """A token as a concept's label shows it: without its surrounding spaces, or, when it is only
    whitespace, with every character visible (a space as the open-box sign) rather than blank."""
    return token.strip() or token_text(token).replace(" ", "\u2423")


def page(title: str, body: str, root: str, nav: Iterable[tuple[str, str]] = ()) -> str:
    """A whole HTML page; `root` is the relative path from the page to the report folder ('' or '../../')."""
    links = "".join(f'<a href="{esc(root + href)}">{esc(text)}</a>' for href, text in nav)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>{esc(title)}</title><link rel="stylesheet" href="{root}static/style.css">'
            f'</head><body><header><h1>{esc(title)}</h1><nav>{links}</nav></header>\n{body}\n</body></html>\n')


def table(head: Sequence[str], rows: Iterable[Sequence[str]], numeric: Sequence[bool] | None = None,
          attrs: str = "") -> str:
    """An HTML table from already-escaped cells; `numeric[i]` right-aligns column i."""
    numeric = numeric or [False] * len(head)
    cls = [' class="num"' if n else "" for n in numeric]
    out = [f"<table{attrs}><thead><tr>" + "".join(f"<th{c}>{h}</th>" for h, c in zip(head, cls)) + "</tr></thead><tbody>"]
    out += ["<tr>" + "".join(f"<td{c}>{v}</td>" for v, c in zip(row, cls)) + "</tr>" for row in rows]
    return "\n".join(out) + "</tbody></table>"


def context_html(tokens: Sequence[str], acts: Sequence[float], center: int, scale: float) -> str:
    """One context: each token shaded by its activation / `scale` (orange positive, blue negative)."""
    parts = []
    for i, (tok, act) in enumerate(zip(tokens, acts)):
        a = min(abs(float(act)) / scale, 1.0) if scale > 0 else 0.0
        cls = ("neg " if act < 0 else "") + ("c" if i == center else "")
        cls_attr = f' class="{cls.strip()}"' if cls.strip() else ""
        shaded = f' style="--a:{a:.2f}" title="{float(act):.3g}"' if a >= 0.005 else ""  # unshaded: no attributes
        parts.append(f'<i{cls_attr}{shaded}>{esc(token_text(tok))}</i>')
    return "".join(parts)
