"""Which concept of one extractor is which concept of another at the same site.

    pairs = match_extractors(atlas.extractors)      # {(a, b): Matching}
    m = pairs["deleuzian", "topk"]; m.rows[0], m.cols[0], m.cos[0]

Directions are compared by the cosine of their unit vectors; the one-to-one matching is the
Hungarian assignment maximising the summed cosine (scipy's `linear_sum_assignment`), and each
concept's best partner (argmax of its row, not necessarily one-to-one) is kept for its page.
"""

from __future__ import annotations

from itertools import combinations
from typing import NamedTuple, Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment

from conceptlens.report.atlas import ExtractorView


class Matching(NamedTuple):
    rows: np.ndarray
    """(m,) concept indices in the first extractor, sorted by decreasing cosine"""
    cols: np.ndarray
    """(m,) their one-to-one partners in the second extractor"""
    cos: np.ndarray
    """(m,) cosine of each matched pair"""
    best_ab: np.ndarray
    """(n_a,) best partner in b of each concept of a (argmax cosine)"""
    best_ab_cos: np.ndarray
    best_ba: np.ndarray
    """(n_b,) best partner in a of each concept of b"""
    best_ba_cos: np.ndarray


def match_directions(a: np.ndarray, b: np.ndarray) -> Matching:
    """Hungarian matching of unit directions `a` (n_a, d) and `b` (n_b, d) by cosine."""
    cos = a @ b.T  # (n_a, n_b)
    rows, cols = linear_sum_assignment(cos, maximize=True)
    matched = cos[rows, cols]
    order = np.argsort(-matched, kind="stable")
    best_ab, best_ba = cos.argmax(1), cos.argmax(0)
    return Matching(rows[order], cols[order], matched[order],
                    best_ab, cos[np.arange(len(a)), best_ab], best_ba, cos[best_ba, np.arange(cos.shape[1])])


def match_extractors(extractors: Sequence[ExtractorView]) -> dict[tuple[str, str], Matching]:
    """Every pair of extractors at the same site whose directions were saved (same width)."""
    out = {}
    for a, b in combinations(extractors, 2):
        if a.site and a.site == b.site and a.directions is not None and b.directions is not None \
                and a.directions.shape[1] == b.directions.shape[1]:
            out[a.name, b.name] = match_directions(a.directions, b.directions)
    return out


def partners(pairs: dict[tuple[str, str], Matching], name: str) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """For extractor `name`: (other extractor, best partner per concept, its cosine) for each pair."""
    out = []
    for (a, b), m in pairs.items():
        if a == name:
            out.append((b, m.best_ab, m.best_ab_cos))
        elif b == name:
            out.append((a, m.best_ba, m.best_ba_cos))
    return out
