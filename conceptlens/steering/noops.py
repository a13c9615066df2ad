"""Edits that provably change nothing, named in one warning line when a steering scope is built.

    lens.steer(Add(v, 5.0, site="blocks.3.attn.k"))      # warns: a constant key shift cancels in the softmax
    lens.steer(ProjectOut(d, site="blocks.3.resid_out"))  # warns if no probe activation has a component along d

- An `Add` at a key site read as the scores use it (`attn.k` passed to the attention function:
  after rotary and any key norm) on every position adds q . c to every score of a query: the
  softmax cancels it (no logit softcapping or attention sink breaks the cancellation).
- A `ProjectOut` (or `Ablate` by projection or mean) whose span holds no component of the
  site's activations over the probe text of `steering.units` (relative size below
  `ORTHOGONAL`): the site's activations live outside it.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from conceptlens.interface import AttachedModel

if TYPE_CHECKING:
    from conceptlens.steering.edits import Edit

ORTHOGONAL = 1e-6
"""Largest |projection| / |activation| (Frobenius, over the probe tokens) that counts as none."""


def warn_if_no_effect(lens: AttachedModel, site: Any, edit: Edit, positions: Any) -> None:
    """One UserWarning when `edit` at `site` (a Site) under `positions` provably changes nothing."""
    from conceptlens.steering.ablate import Ablate
    from conceptlens.steering.edits import Add, ProjectOut

    if type(edit) is Add and site.point == "k" and _every_position(positions) and not _breaks_shift(lens, site):
        warnings.warn(f"Add at {site.name} on every position shifts every key by the same vector, which cancels in "
                      "the softmax: it changes nothing; steer some positions (e.g. positions='generated') or "
                      "attn.q / attn.v", UserWarning, stacklevel=5)
    elif isinstance(edit, ProjectOut) or (isinstance(edit, Ablate) and edit.mode != "zero"):
        relative = _component(lens, site.name, edit.basis)
        if relative is not None and relative < ORTHOGONAL:
            warnings.warn(f"{type(edit).__name__} at {site.name}: the site's activations have no component along "
                          f"these directions (relative size {relative:.1e} over the probe text): it changes "
                          "nothing", UserWarning, stacklevel=5)


def _every_position(positions: Any) -> bool:
    if isinstance(positions, slice):
        return positions.start in (None, 0) and positions.stop is None
    return positions == "all"


def _breaks_shift(lens: AttachedModel, site: Any) -> bool:
    """Logit softcapping (tanh of the scores) or a learned sink logit make a constant score shift count."""
    config = lens.model.config
    configs = [config, getattr(config, "text_config", None)]
    softcap = any(getattr(c, "attn_logit_softcapping", None) for c in configs if c is not None)
    return softcap or getattr(site.module, "sinks", None) is not None


def _component(lens: AttachedModel, name: str, basis: Any) -> float | None:
    """|acts Q^T| / |acts| over the probe tokens at the site, or None when the lens cannot run the probe."""
    from conceptlens.steering.units import probe_ready, site_scale

    if not probe_ready(lens):
        return None
    acts = site_scale(lens, name).acts.double()
    total = float(acts.norm())
    return float((acts @ basis.double().cpu().T).norm()) / total if total > 0 else None  # (the probe's rows: CPU)
