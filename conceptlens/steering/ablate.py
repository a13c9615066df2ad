"""Ablation modes: take concepts out of a site's activations, three ways.

    lens.steer(Ablate(cs[[3, 7]].centred(), mode="mean"), positions=slice(1, None))
    lens.ablate(cs[[3, 7]], mode="projection")          # the same through the lens

With Q `(r, d)` an orthonormal basis of the span of the directions and m the set's mean
activation (`ConceptSet.mean`, or `mean=`):

- "projection": x - Q^T Q x. The component along the span becomes 0. Raw k-means centroids
  point along the mean activation, so projecting them out also removes most of the mean:
  on SmolLM2 that alone costs as much as the concepts (centre them first, `cs.centred()`).
- "mean": x - Q^T Q (x - m). The component is replaced by the mean's: only the variation
  along the span is removed, the typical value stays (mean-ablation).
- "zero": the activation of every edited token is set to 0. Not about the directions (only
  their site is used): the site-level reference of how much removing everything costs,
  next to which a concept ablation is read (`conceptlens ablate` prints it).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.steering.edits import Concepts, Edit, ProjectOut, _site_of

Mode = Literal["projection", "mean", "zero"]
MODES = ("projection", "mean", "zero")


class Ablate(Edit):
    """Ablate the span of `concepts` at their site by `mode` (see the module docstring)."""

    def __init__(self, concepts: Concepts, mode: Mode = "projection", *, mean: Tensor | None = None,
                 site: str | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
        self.site = _site_of(concepts, site)
        self.mode = mode
        projection = ProjectOut(concepts, site=self.site)
        self.basis = projection.basis  # (r, d) orthonormal rows
        self.width, self.model = projection.width, projection.model
        if mean is None and isinstance(concepts, ConceptSet):
            mean = concepts.mean
        if mode == "mean" and mean is None:
            raise ValueError("mode='mean' needs the mean activation: a ConceptSet that carries one (k-means, "
                             "Deleuzian, VQ fits) or mean=")
        self.mean = None if mean is None else torch.as_tensor(mean).detach().float().reshape(-1)
        if self.mean is not None and self.mean.shape[0] != self.basis.shape[1]:
            raise ValueError(f"mean has width {self.mean.shape[0]}; the directions have {self.basis.shape[1]}")
        if self.mean is not None and not torch.isfinite(self.mean).all():
            bad = (~torch.isfinite(self.mean)).nonzero().flatten().tolist()
            raise ValueError(f"mean holds NaN or inf at coordinate{'s' if len(bad) > 1 else ''} {bad[:8]}; "
                             "mean-ablation needs a finite mean")
        # the mean's component along the span, (d,): what mean-ablation puts back
        self.offset = None if self.mean is None else (self.mean @ self.basis.T) @ self.basis

    def apply(self, x: Tensor, mask: Tensor | None) -> Tensor:
        if self.mode == "zero":
            return self._select(x, torch.zeros_like(x), mask)
        basis = self.basis.to(x.device)
        xf = x.float()  # in bf16 the projection would leave ~1e-2 of the component
        new = xf - (xf @ basis.T) @ basis
        if self.mode == "mean" and self.offset is not None:  # mean mode always has one (checked when made)
            new = new + self.offset.to(x.device)
        return self._select(x, new.to(x.dtype), mask)
