"""NormAudit: how much of the variance the largest-norm rows that passed the filter carry.

    audit = NormAudit()                       # fed by a fit like any extractor
    lens.fit({"blocks.15.resid_out": {"topk": sae, "norms": audit}}, "bbc-news")
    audit.stats()   # {'median_norm': 174.0, 'max_norm_ratio': 3.1, 'top_share': 0.04, ...}

The row filter drops tokens above `max_norm_ratio` times the running median norm, but
outliers just under that bar can still dominate a fit: on Gemma-3-270m, "'" tokens at 9.6x
the median norm carried 74% of the variance and took over every Deleuzian concept. The audit
keeps a uniform reservoir of the rows the extractors saw (Algorithm R, its own generator) and
reports the share of the centred variance, sum |x_i - mean|^2, carried by the `top_fraction`
largest-norm rows of the sample (their share of the rows is `top_fraction`; a share near
that is healthy, a share near 1 means those few tokens are what every extractor describes).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from conceptlens.concepts.deleuzian import reservoir_update


class NormAudit:
    """A uniform sample of `size` rows and the variance share of its largest-norm rows."""

    def __init__(self, size: int = 8192, top_fraction: float = 0.01, seed: int = 0) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 100:
            raise ValueError(f"size must be an int >= 100; got {size!r}")
        if not 0 < top_fraction < 0.5:
            raise ValueError(f"top_fraction must be in (0, 0.5); got {top_fraction!r}")
        self.size, self.top_fraction = size, float(top_fraction)
        self.generator = torch.Generator().manual_seed(seed)
        self.sample: Tensor | None = None
        self.n_seen = 0

    def update(self, x: Tensor) -> None:
        """x: `(N, d)` rows that passed the filter."""
        x = x.detach().float().cpu()
        if self.sample is None:
            self.sample = torch.zeros(self.size, x.shape[1])
        self.n_seen = reservoir_update(self.sample, self.n_seen, x, self.generator)

    def flush(self) -> None:
        pass

    def merge(self, other: NormAudit) -> None:
        """Pool two samples in proportion to the rows each saw (a uniform sample of both streams)."""
        if other.sample is None:
            return
        if self.sample is None:
            self.sample, self.n_seen = other.sample.clone(), other.n_seen
            return
        mine, theirs = self._rows(), other._rows()
        total = self.n_seen + other.n_seen
        k_mine = round(self.size * self.n_seen / total)
        pick = lambda rows, k: rows[torch.randperm(len(rows), generator=self.generator)[:k]]  # noqa: E731
        pooled = torch.cat([pick(mine, k_mine), pick(theirs, self.size - k_mine)])
        self.sample = torch.zeros(self.size, pooled.shape[1])
        self.sample[:len(pooled)] = pooled
        self.n_seen = total

    def _rows(self) -> Tensor:
        assert self.sample is not None
        return self.sample[:min(self.n_seen, self.size)]

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "top_fraction": self.top_fraction, "n_seen": self.n_seen,
                "sample": self.sample, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["size"] != self.size:
            raise ValueError(f"the saved audit keeps {state['size']} rows, this one {self.size}")
        self.top_fraction, self.n_seen, self.sample = state["top_fraction"], state["n_seen"], state["sample"]
        self.generator.set_state(state["generator"])

    def stats(self) -> dict[str, float]:
        """median_norm, max_norm_ratio (largest / median), top_share (variance share of the
        top_fraction largest-norm rows of the sample), rows (seen) and sample (kept)."""
        if self.sample is None or self.n_seen < 100:
            return {"rows": self.n_seen}
        x = self._rows().double()
        norms = x.norm(dim=1)
        median = norms.median()
        k = max(1, round(self.top_fraction * len(x)))
        top = norms.topk(k).indices
        spread = (x - x.mean(0)).pow(2).sum(1)  # (R,) each row's share of the centred variance
        return {"rows": self.n_seen, "sample": len(x), "median_norm": float(median),
                "max_norm_ratio": float(norms.max() / median), "top_fraction": self.top_fraction,
                "top_share": float(spread[top].sum() / spread.sum())}

    def summary(self) -> str:
        s = self.stats()
        if "top_share" not in s:
            return f"norm audit: too few rows ({s['rows']})"
        return (f"largest-norm {s['top_fraction']:.0%} of kept tokens carry {s['top_share']:.1%} of the variance "
                f"({s['top_fraction']:.0%} if every token carried the same); max norm {s['max_norm_ratio']:.1f}x the median "
                f"{s['median_norm']:.3g} (sample of {s['sample']:,} of {s['rows']:,} rows)")
