"""One figure of the suite next to its baselines, and the markdown table they print as.

    Line("topk", "bbc-news k=5 accuracy", Estimate(0.91, 0.88, 0.94), [("random 1024 dirs", est)], "note")
    print(format_lines(lines))

`verdict` compares a figure with its first baseline (the matched control): "wins" or "loses"
when the two 95% intervals do not overlap, "overlaps" otherwise. A line with `concept` set is
about one concept of the set (its probe or steering score): the atlas shows it on that
concept's page rather than in the index's table.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

from conceptlens.evaluate.bootstrap import Estimate


class Line(NamedTuple):
    extractor: str
    """the concept set the figure is about"""
    metric: str
    value: Estimate
    baselines: list[tuple[str, Estimate]]
    """(name, figure) of each baseline; the first is the matched control"""
    note: str = ""
    higher_is_better: bool = True
    concept: int | None = None
    """the one concept of the set the figure is about (a concept page shows it); None: the whole set"""


def verdict(line: Line) -> Literal["wins", "loses", "overlaps", ""]:
    """Against the first baseline, by the 95% intervals (blank without intervals or baselines)."""
    if not line.baselines:
        return ""
    base = line.baselines[0][1]
    a, b = line.value, base
    if any(math.isnan(v) for v in (a.low, a.high, b.low, b.high)):
        return ""
    if a.low > b.high:
        return "wins" if line.higher_is_better else "loses"
    if a.high < b.low:
        return "loses" if line.higher_is_better else "wins"
    return "overlaps"


def format_lines(lines: list[Line]) -> str:
    """A markdown table: extractor, metric, value [95% interval], each baseline, verdict, note."""
    header = "| extractor | metric | value [95% CI] | baselines [95% CI] | vs first baseline | note |"
    out = [header, "|---|---|---|---|---|---|"]
    for line in lines:
        bases = "; ".join(f"{name} {est}" for name, est in line.baselines)
        out.append(f"| {line.extractor} | {line.metric} | {line.value} | {bases} | {verdict(line)} | {line.note} |")
    return "\n".join(out)
