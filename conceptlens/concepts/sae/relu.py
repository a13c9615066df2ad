"""ReLUSAE: the standard SAE as in Anthropic's April 2024 update: free decoder norms, L1 weighted by them.

    sae = ReLUSAE(width=4608, l1=5.0, seed=0)

z = ReLU((x - b_dec) W_enc + b_enc), x_hat = z W_dec + b_dec; loss ||x - x_hat||^2 +
l1 sum_i z_i ||W_dec,i||. The decoder rows are NOT renormalised during training (unlike the
original recipe with unit-norm columns): the penalty weighs each latent by its row's norm, so
it cannot be lowered by shrinking latents while growing rows. As in the update, the decoder
starts with random directions of norm 0.1 and W_enc = W_dec^T.

Export keeps the trained parametrisation: `concept_set()` directions are the decoder rows with
their learned norms and `encode` gives the latents z as trained (so z_i W_dec,i is latent i's
part of the reconstruction, and a SAELens "standard" file imports exactly). Anthropic reports
feature activations as z_i ||W_dec,i||; multiply by `cs.directions.norm(dim=1)` for those.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from conceptlens.concepts.sae.base import Code, SparseAutoencoder
from conceptlens.concepts.sae.config import SAEConfig, check_float


@dataclass(kw_only=True)
class ReLUConfig(SAEConfig):
    """ReLUSAE hyper-parameters."""

    l1: float = 5.0
    """Sparsity coefficient, in units of the squared error of inputs scaled to E||x||^2 = d."""
    decoder_init_norm: float = 0.1
    """Norm of the initial decoder rows (the April 2024 update: about 0.1)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float("l1", self.l1)
        check_float("decoder_init_norm", self.decoder_init_norm, strict=True)


class ReLUSAE(SparseAutoencoder):
    """z = ReLU((x - b_dec) W_enc + b_enc); loss ||x - x_hat||^2 + l1 sum_i z_i ||W_dec,i||."""

    Config = ReLUConfig
    method = "relu_sae"
    unit_decoder = False
    config: ReLUConfig

    def _init_params(self, x: Tensor) -> dict[str, Tensor]:
        params = super()._init_params(x)
        W_dec = params["W_dec"] * self.config.decoder_init_norm
        return {**params, "W_dec": W_dec, "W_enc": W_dec.T.clone()}

    def _activate(self, pre: Tensor, w: dict[str, Tensor], train: bool) -> Tensor:
        return pre.relu()

    def _penalty(self, x: Tensor, x_hat: Tensor, code: Code, w: dict[str, Tensor]) -> Tensor:
        return self.config.l1 * (code.z * w["W_dec"].norm(dim=1)).sum(-1).mean()
