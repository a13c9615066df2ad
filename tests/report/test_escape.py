"""The report's one escape, `report.html.esc`, per context: each round-trips through the
standard library's own decoder and leaves nothing that could end its context."""

from __future__ import annotations

import html
import json
from urllib.parse import unquote

import pytest

from conceptlens.report.html import esc

HOSTILE = ["x'><img src=x onerror=alert(1)>", 'a"b&c', "</script><script>alert(1)</script>", "javascript:alert(1)",
           "a b/../c?d#e%41", "\u2028\u2029", "plain"]


@pytest.mark.parametrize("text", HOSTILE)
def test_each_context_round_trips_and_cannot_break_out(text):
    assert html.unescape(esc(text)) == text and not set("<>\"'") & set(esc(text))
    url = esc(text, "url")
    assert unquote(html.unescape(url)) == text and not set("<>\"' :?#") & set(url)
    js = esc({"k": [text, 1.5, None]}, "js")
    assert json.loads(js) == {"k": [text, 1.5, None]} and not set("<>&\u2028\u2029") & set(js)


def test_bidi_controls_are_shown_not_obeyed():
    controls = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c"
    shown = esc(f"a{controls}b (0.102)")
    assert not set(controls) & set(shown) and shown.startswith("a\u27e8U+202A\u27e9") and shown.endswith("b (0.102)")
    assert shown.count("\u27e8U+") == len(controls) and "\u27e8U+061C\u27e9" in shown
    assert esc("\u05e9\u05dc\u05d5\u05dd") == "\u05e9\u05dc\u05d5\u05dd"  # right-to-left letters are text, kept
