"""NormWatch: which described tokens have the largest norms, and how much of the variance they carry.

    watch = NormWatch(window=(8, 4))              # one per site, inside its first ConceptDescriber
    watch.update(x, doc, pos, ids, first_doc)     # the rows the row filter kept
    watch.summary(decode)                         # {'top_share': 0.74, 'largest': [["'", 61], ...], ...}

The row filter (`filters.py`) drops rows far above the running median norm and counts them;
rows just under its bar can still carry most of the variance (on Gemma-3-270m, "'" tokens at
9.6x the median). The watch keeps the `k` largest-norm tokens exactly (a `TopN` over one
"concept", the norm) and a `NormAudit` reservoir for the centred-variance share of the 1%
largest-norm rows, the same figure the fit's audit reports.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
from torch import Tensor

from conceptlens.describe.topn import TopN
from conceptlens.norm_audit import NormAudit

DOMINATED = 0.25
"""Flag a site when its 1% largest-norm tokens carry more than this share of the variance (25x their share)."""


class NormWatch:
    def __init__(self, window: tuple[int, int] = (8, 4), k: int = 64, seed: int = 0) -> None:
        self.top = TopN(1, k, window)
        self.audit = NormAudit(seed=seed)

    def update(self, x: Tensor, doc: Tensor, pos: Tensor, ids: Tensor, first_doc: int) -> None:
        """x `(N, d)` kept rows with their document (in the source), position, batch ids `(B, T)`."""
        norms = torch.linalg.vector_norm(x.float(), dim=1)[:, None]  # (N, 1)
        self.top.update(norms, doc, pos, ids, first_doc)
        self.audit.update(x)

    def state_dict(self) -> dict[str, Any]:
        return {"top": self.top.state_dict(), "audit": self.audit.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.top.load_state_dict(state["top"])
        self.audit.load_state_dict(state["audit"])

    def merge(self, other: NormWatch) -> None:
        self.top.merge(other.top)
        self.audit.merge(other.audit)

    def summary(self, decode: Callable[[list[int]], dict[int, str]]) -> dict[str, Any]:
        """The audit's figures, `largest`: [[token, count], ...] among the k largest-norm tokens
        (most frequent first), and `dominated`: whether the top 1% carry more than DOMINATED."""
        out: dict[str, Any] = dict(self.audit.stats())
        if self.top.values is None:
            return out
        used = self.top.doc[0] >= 0
        centre = self.top.window_ids[0, used, self.top.window[0]].cpu().tolist()
        text = decode(sorted(set(centre)))
        counts = Counter(text[t] for t in centre)
        out["largest"] = [[t, c] for t, c in counts.most_common(8)]
        out["largest_norm"] = float(self.top.values[0, 0])
        if out.get("median_norm"):  # the exact largest, not the sample's
            out["max_norm_ratio"] = out["largest_norm"] / out["median_norm"]
        out["dominated"] = bool(out.get("top_share", 0.0) > DOMINATED)
        return out
