"""A concept's activation histogram as inline SVG, each bar as wide as its bin.

The description's display bins are whole groups of its fixed log-spaced bins, so their widths
differ (narrow near 0, wide far out). Drawn as equal bars they turn a unimodal distribution
into two humps; here every bar spans its bin on a linear activation axis and its height is
the density (tokens per unit of activation), so areas are counts.
"""

from __future__ import annotations

import numpy as np


def histogram_svg(edges: np.ndarray, counts: np.ndarray, width: int = 420, height: int = 130) -> str:
    """Bars of `counts` (B,) over `edges` (B+1,) at their real widths, as inline SVG."""
    counts = np.asarray(counts, dtype=np.float64)
    edges = np.asarray(edges, dtype=np.float64)
    if counts.size == 0 or counts.sum() <= 0 or not np.isfinite(edges).all() or edges[-1] <= edges[0]:
        return '<p class="muted">no activations recorded</p>'
    widths = np.diff(edges)
    density = np.where(widths > 0, counts / np.where(widths > 0, widths, 1.0), 0.0)
    pad, base = 6, height - 18
    lo, hi = float(edges[0]), float(edges[-1])
    x = lambda v: pad + (width - 2 * pad) * (v - lo) / (hi - lo)  # noqa: E731
    top = density.max()
    bars = []
    for i, c in enumerate(counts):
        if c <= 0:
            continue
        h = max((base - 6) * density[i] / top, 1.0)
        x0, x1 = x(edges[i]), x(edges[i + 1])
        bars.append(f'<rect x="{x0:.2f}" y="{base - h:.1f}" width="{max(x1 - x0, 0.6):.2f}" height="{h:.1f}" '
                    f'fill="#f08a24"><title>[{edges[i]:.3g}, {edges[i + 1]:.3g}): {int(c)} tokens</title></rect>')
    zero = ""
    if lo < 0 < hi:
        zero = (f'<line x1="{x(0.0):.1f}" y1="4" x2="{x(0.0):.1f}" y2="{base}" stroke="#555" stroke-dasharray="3 2"/>'
                f'<text x="{x(0.0):.1f}" y="{height - 4}" text-anchor="middle">0</text>')
    return (f'<svg width="{width}" height="{height}" role="img" aria-label="activation histogram">'
            + "".join(bars) + zero
            + f'<line x1="{pad}" y1="{base}" x2="{width - pad}" y2="{base}" stroke="#999"/>'
            + f'<text x="{pad}" y="{height - 4}">{lo:.3g}</text>'
            + f'<text x="{width - pad}" y="{height - 4}" text-anchor="end">{hi:.3g}</text></svg>')
