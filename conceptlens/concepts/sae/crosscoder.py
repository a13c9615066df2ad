"""Crosscoders: one sparse dictionary that reads and writes several sites (Lindsey et al. 2024).

    cc = Crosscoder(width=4096, k=32, seed=0)     # TopK gate; ReLUCrosscoder: the paper's L1
    for xs in stream:                             # the same tokens at m sites
        cc.update(*xs)                            # lens.fit({("blocks.2.resid_out", "blocks.6.resid_out"): cc})
    z = cc.encode(*xs)                            # (N, width)
    ys = cc.reconstruct(*xs)                      # one (N, d_i) tensor per site
    cc.fvu(*xs)                                   # FVU per site

The acausal crosscoder of Anthropic's note ("Sparse Crosscoders", Dec 2024): the encoder reads
every site, f = act(sum_i W_enc^i x_i + b_enc), which is one product with the concatenation
[x_1 | ... | x_m]; the decoder writes every site, x_hat_i = f W_dec^i + b_dec^i; the loss is
summed over sites, sum_i ||x_i - x_hat_i||^2. `ReLUCrosscoder` adds the note's sparsity penalty,
lambda sum_j f_j sum_i ||W_dec,j^i|| (the L1 of the per-site decoder norms, so a latent pays for
every site it writes); it trains like `ReLUSAE` (free decoder norms, `l1` in units of the spread).
`Crosscoder`, the default, gates with TopK instead (Gao et al.; the k largest pre-activations,
AuxK for dead latents), with each latent's concatenated decoder row at unit norm, so it is a
`TopKSAE` over the concatenation.

Each site has its own warm-up scale c_i (multisite.py); the export folds them: W_enc rows times
c, b_dec and W_dec columns divided by c, latents stay in the trained units. Replicas merge by
averaging, as other SAEs do; `fit(distributed=True)` gives every rank the global rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.concepts.sae.base import Code
from conceptlens.concepts.sae.multisite import MultiSite
from conceptlens.concepts.sae.relu import ReLUConfig, ReLUSAE
from conceptlens.concepts.sae.topk import TopKConfig, TopKSAE


def fvu_per_site(targets: list[Tensor], predictions: list[Tensor]) -> list[float]:
    """Fraction of variance unexplained at each site: sum ||y - y_hat||^2 / sum ||y - mean(y)||^2."""
    out = []
    for y, y_hat in zip(targets, predictions):
        y, y_hat = y.double(), y_hat.to(y.device).double()
        out.append(float((y - y_hat).pow(2).sum() / (y - y.mean(0)).pow(2).sum().clamp(min=1e-300)))
    return out


class _Acausal(MultiSite):
    """What both crosscoders share: m >= 2 sites in, the same m sites out."""

    distributed = None
    directions_at = "sites"  # each decoder row spans every site (fit_keys.where)

    def __init__(self, config: Any = None, /, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._init_sites()

    def update(self, *sites: Tensor) -> None:
        """Buffer the rows of every site, `(N, d_1)`, ..., `(N, d_m)`: the same tokens at each."""
        if len(sites) < 2:
            raise TypeError(f"{type(self).__name__}.update takes one tensor per site (two or more); got {len(sites)}; "
                            "fit it with a key of several sites")
        super().update(self._join(sites))

    def _check_sites(self, shape: list[int], widths: list[int]) -> None:
        if any(n != 1 for n in shape):
            raise ValueError(f"{type(self).__name__}.update takes one tensor per site, not groups; got {shape}")

    def _fold(self, w: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
        c = self.columns()  # (d,)
        return {"W_enc": w["W_enc"] * c[:, None], "b_enc": w["b_enc"], "W_dec": w["W_dec"] / c, "b_dec": w["b_dec"] / c}

    def _rows(self, sites: tuple[Tensor, ...]) -> Tensor:
        x = sites[0] if len(sites) == 1 else torch.cat([t.to(sites[0].device) for t in sites], 1)
        if x.ndim != 2 or x.shape[1] != sum(self.widths or [-1]):
            raise ValueError(f"expected one tensor per site of widths {self.widths} (or their concatenation); "
                             f"got {[tuple(t.shape) for t in sites]}")
        return x

    @torch.no_grad()
    def encode(self, *sites: Tensor) -> Tensor:
        """Raw rows of every site (or their concatenation) -> latents `(N, width)`."""
        return super().encode(self._rows(sites))

    @torch.no_grad()  # by design the reconstruction is one tensor per site, not one row block
    def reconstruct(self, *sites: Tensor) -> list[Tensor]:  # type: ignore[override]
        """Raw rows of every site -> each site reconstructed, `[(N, d_1), ..., (N, d_m)]`."""
        return self.split(self.decode(self.encode(*sites)))

    def fvu(self, *sites: Tensor) -> list[float]:
        """FVU at each site for held-out rows of every site."""
        return fvu_per_site(self.split(self._rows(sites).float()), self.reconstruct(*sites))

    def concept_set(self) -> ConceptSet:
        """Decoder rows `(width, sum d_i)`: each latent's directions at every site, side by side
        (`config["widths"]` splits them; `split_concept_set` gives one set per site)."""
        cs = super().concept_set()
        cs.config["widths"] = list(self._sites()[1])
        return cs


@dataclass(kw_only=True)
class CrosscoderConfig(TopKConfig):
    """Crosscoder hyper-parameters: those of `TopKSAE`, over the concatenated sites."""


class Crosscoder(_Acausal, TopKSAE):
    """f = TopK([x_1 | ... | x_m] W_enc + b_enc); x_hat_i = f W_dec^i + b_dec^i; see the module docstring."""

    Config = CrosscoderConfig
    method = "crosscoder"


@dataclass(kw_only=True)
class ReLUCrosscoderConfig(ReLUConfig):
    """ReLUCrosscoder hyper-parameters: those of `ReLUSAE`."""


class ReLUCrosscoder(_Acausal, ReLUSAE):
    """f = ReLU(...); loss sum_i ||x_i - x_hat_i||^2 + lambda sum_j f_j sum_i ||W_dec,j^i|| (the note's)."""

    Config = ReLUCrosscoderConfig
    method = "relu_crosscoder"

    def _penalty(self, x: Tensor, x_hat: Tensor, code: Code, w: dict[str, Tensor]) -> Tensor:
        norms = sum(block.norm(dim=1) for block in w["W_dec"].split(self.widths, dim=1))  # (width,)
        return self.l1_now() * w["l1_unit"] * (code.z * norms).sum(-1).mean()


def split_concept_set(cs: ConceptSet, sites: list[str] | None = None) -> dict[str, ConceptSet]:
    """One ConceptSet per site of a multi-site set (crosscoder, cross-layer transcoder): the decoder
    block at that site. `sites` defaults to those the fit recorded (`config["fit"]["sites"]`)."""
    widths = cs.config.get("widths")
    if not widths:
        raise ValueError(f"ConceptSet method {cs.method!r} has no per-site widths; it is not a multi-site set")
    fit = got if isinstance(got := cs.config.get("fit"), dict) else {}
    sites = sites or fit.get("targets") or [f"site_{i}" for i in range(len(widths))]
    if len(sites) != len(widths):
        raise ValueError(f"{len(sites)} site names for a set of {len(widths)} sites")
    blocks = cs.directions.split(widths, dim=1)
    means = cs.mean.split(widths) if cs.mean is not None else [None] * len(widths)
    return {site: ConceptSet(block, site, method=cs.method, config={**cs.config, "site_index": i}, model=cs.model,
                             stats=cs.stats, mean=mean)
            for i, (site, block, mean) in enumerate(zip(sites, blocks, means))}
