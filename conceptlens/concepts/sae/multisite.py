"""Rows from several sites at once: the shared plumbing of crosscoders and cross-layer transcoders.

    class Crosscoder(MultiSite, TopKSAE): ...     # MultiSite first, so its hooks run
    cc.update(x_a, x_b, x_c)                     # the same tokens at three sites
    cc.update((x_0, x_1), (y_0, y_1))            # groups of sites (a cross-layer transcoder)

A row travels through the mixing buffer as the concatenation of its sites, [x_1 | ... | x_m]
(groups flattened in order); `widths` records each site's width. Each site gets its own
warm-up scale (E||s_i x_i||^2 = d_i over the first `warmup_tokens` rows), so a site with a
large norm does not drown the others (the crosscoder paper normalises each layer's
activations the same way); `columns()` expands them to the `(d,)` column scales. The sums are
float64 and pooled exactly when replicas still warming up merge.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import Tensor

from conceptlens.concepts.base import NotFittedError
from conceptlens.concepts.sae.buffers import merge_warm_up

if TYPE_CHECKING:  # the mixin always comes before a SparseAutoencoder in the MRO: check it as one
    from conceptlens.concepts.sae.base import SparseAutoencoder as _SAE
else:
    _SAE = object

Groups = Sequence[Tensor | Sequence[Tensor]]


class MultiSite(_SAE):
    """Mixin for a `SparseAutoencoder` whose rows are several sites side by side."""

    own_state = ("widths", "shape")  # saved with the state

    def _init_sites(self) -> None:
        self.widths: list[int] | None = None
        self.shape: list[int] | None = None  # sites per group, e.g. [L, L] for a CLT

    # ---- rows -----------------------------------------------------------------------------
    def _join(self, groups: Groups) -> Tensor:
        """Check and concatenate the sites of one update: `(N, sum of widths)`."""
        name = type(self).__name__
        shape = [1 if isinstance(g, Tensor) else len(g) for g in groups]
        flat = [t for g in groups for t in ((g,) if isinstance(g, Tensor) else g)]
        for i, x in enumerate(flat):
            if not isinstance(x, Tensor) or x.ndim != 2 or not x.is_floating_point():
                got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(f"{name}.update expects float tensors (N, d), one per site; site {i} is {got}")
        if len({x.shape[0] for x in flat}) > 1:
            raise ValueError(f"every site must hold the same tokens; got {[x.shape[0] for x in flat]} rows")
        widths = [x.shape[1] for x in flat]
        if self.widths is None:
            self._check_sites(shape, widths)
            self.widths, self.shape = widths, shape
        elif widths != self.widths or shape != self.shape:
            raise ValueError(f"{name} was fitted on sites of widths {self._layout(self.shape, self.widths)}; "
                             f"got {self._layout(shape, widths)}")
        return torch.cat([x.to(flat[0].device, flat[0].dtype) for x in flat], 1)

    @staticmethod
    def _layout(shape: list[int] | None, widths: list[int]) -> list[Any]:
        out, i = [], 0
        for n in shape or [1] * len(widths):
            out.append(widths[i] if n == 1 else widths[i:i + n])
            i += n
        return out

    def _check_sites(self, shape: list[int], widths: list[int]) -> None:
        """A variant's rule on the sites it reads (how many, which widths must agree)."""

    def _sites(self) -> tuple[list[int], list[int]]:
        """(sites per group, widths) of the fitted sites; NotFittedError before the first update."""
        if self.shape is None or self.widths is None:
            raise NotFittedError(f"{type(self).__name__} has seen no rows yet: its sites are unknown")
        return self.shape, self.widths

    def split(self, x: Tensor) -> list[Tensor]:
        """A concatenated row block `(N, d)` -> one `(N, d_i)` tensor per site."""
        return list(x.split(self.widths, dim=-1))

    def columns(self) -> Tensor:
        """`(d,)` the per-site warm-up scales, one per column of a row."""
        scales = self.buffer_dict["site_scale"]
        return torch.repeat_interleave(scales, torch.tensor(self.widths, device=scales.device))

    # ---- per-site warm-up scales ----------------------------------------------------------
    def _warm_up(self, rows: Tensor) -> None:
        sums = torch.stack([t.pow(2).sum() for t in self.split(rows.double())]).cpu()
        self.buffer_dict["warm_sq"] = self.buffer_dict["warm_sq"] + sums if "warm_sq" in self.buffer_dict else sums

    def _set_scale(self, sum_sq: float, rows: int) -> None:
        super()._set_scale(sum_sq, rows)
        n, sums = rows, self.buffer_dict.pop("warm_sq")
        if not (sums > 0).all():
            bad = int((sums <= 0).nonzero()[0])
            raise ValueError(f"the first {n} rows are all zero at site {bad}; cannot normalise its scale")
        widths = torch.tensor(self.widths, dtype=torch.float64)
        self.buffer_dict["site_scale"] = (widths * n / sums).sqrt().float().to(self.tensor_device)

    def _normalise(self, x: Tensor) -> Tensor:
        return x * self.columns().to(x.device)

    # ---- replicas -------------------------------------------------------------------------
    def _merge(self, other: Any) -> None:
        if self.widths is not None and other.widths is not None and other.widths != self.widths:
            raise ValueError(f"cannot merge sites of widths {other.widths} into sites of widths {self.widths}")
        if self.widths is None:
            self.widths, self.shape = other.widths, other.shape
        merge_warm_up(self, other)
        super()._merge(other)
