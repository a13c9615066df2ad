"""Where a quantity depends on a gauge: q/k sites, and the warning raised there.

    warn_if_qk("blocks.3.attn.k", "cosine")     # GaugeWarning: key cosines are not model properties
    is_qk_site(site)                            # a Site (point "q"/"k") or a canonical name

At a q or k site the model is unchanged by W_Q -> A W_Q, W_K -> A^-T W_K for any invertible A
per head (commuting with the rotary rotations where there are any), so no bilinear form is
invariant there: norms, cosines, Euclidean distances, PCA, effective rank, log-det, and every
representation similarity that is only similarity-invariant (CKA, Procrustes, k-NN) change with
the gauge (SPECS.md, 004). Quantities invariant to the general linear group (CCA, or the query-
weighted metrics of `conceptlens.metrics.gauge`) are safe and raise nothing.
"""

from __future__ import annotations

import warnings
from typing import Any


class GaugeWarning(UserWarning):
    """A gauge-dependent quantity was computed at a q/k site."""


def _point(site: Any) -> str | None:
    point = getattr(site, "point", None)
    if point is not None:
        return str(point)
    name = getattr(site, "name", site)
    if not isinstance(name, str):
        return None
    last = name.rsplit(".", 1)[-1]
    return {"q": "q", "k": "k", "q_proj": "q", "k_proj": "k", "query": "q", "key": "k"}.get(last)


def is_qk_site(site: Any) -> bool:
    """True for a `Site` whose point is "q" or "k", or a name ending in .q / .k / .q_proj / .k_proj."""
    return _point(site) in ("q", "k")


def warn_if_qk(site: Any, quantity: str, stacklevel: int = 3) -> bool:
    """Warn (GaugeWarning) when `quantity` is computed at a q/k `site`; returns whether it warned."""
    if site is None or not is_qk_site(site):
        return False
    name = getattr(site, "name", site)
    warnings.warn(f"{quantity} at the {_point(site)} site {name!r} depends on the q/k gauge "
                  "(W_Q -> A W_Q, W_K -> A^-T W_K leaves the model unchanged): it is not a model property; "
                  "use the query-weighted metrics of conceptlens.metrics.gauge or a GL-invariant measure (CCA)",
                  GaugeWarning, stacklevel=stacklevel)
    return True
