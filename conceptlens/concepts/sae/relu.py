"""ReLUSAE: the standard SAE as in Anthropic's April 2024 update: free decoder norms, L1 weighted by them.

    sae = ReLUSAE(width=4608, l1=1.5, seed=0)

z = ReLU((x - b_dec) W_enc + b_enc), x_hat = z W_dec + b_dec; loss ||x - x_hat||^2 +
lambda sum_i z_i ||W_dec,i||. The decoder rows are NOT renormalised during training (unlike the
original recipe with unit-norm columns): the penalty weighs each latent by its row's norm, so
it cannot be lowered by shrinking latents while growing rows. As in the update, the decoder
starts with random directions of norm 0.1 and W_enc = W_dec^T, and lambda can rise linearly
from 0 over the first `l1_warmup_tokens` (the update: 5% of training; a stream's length is not
known in advance, so the default is no ramp).

The coefficient's unit: the update's lambda = 5 is for inputs scaled to E||x||^2 = d, where
the mean's share of the norm decides how strong it is. Here lambda = l1 * s, with s the RMS
spread per feature sqrt(E||x - mean||^2 / d) of the scaled first batch, so `l1` is the
coefficient for centred inputs with E||x - mean||^2 = d. On a planted dictionary whose offset
carries 97% of the norm (tests/concepts/sae/test_planted.py) the old default lambda = 5 left
every latent dead (0% of the atoms recovered, as did lambda 2); l1 = 1.5 recovers 98-100% (TopK
100%) at held-out FVU 0.19-0.21.

Export keeps the trained parametrisation: `concept_set()` directions are the decoder rows with
their learned norms and `encode` gives the latents z as trained (so z_i W_dec,i is latent i's
part of the reconstruction, and a SAELens "standard" file imports exactly). Anthropic reports
feature activations as z_i ||W_dec,i||; multiply by `cs.directions.norm(dim=1)` for those.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from conceptlens.concepts.sae.base import Code, SparseAutoencoder
from conceptlens.concepts.sae.config import SAEConfig, check_float, check_int


@dataclass(kw_only=True)
class ReLUConfig(SAEConfig):
    """ReLUSAE hyper-parameters."""

    l1: float = 1.5
    """Sparsity coefficient, in units of inputs whose spread is E||x - mean||^2 = d (the penalty
    is l1 * s * sum_i z_i ||W_dec,i|| on inputs scaled to E||x||^2 = d, where s is their RMS spread
    per feature on the first batch); see the module docstring."""
    decoder_init_norm: float = 0.1
    """Norm of the initial decoder rows (the April 2024 update: about 0.1)."""
    l1_warmup_tokens: int = 0
    """Trained tokens over which the L1 coefficient rises linearly from 0 to `l1` (the April 2024
    update: the first 5% of training); 0 applies it in full from the first step."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float("l1", self.l1)
        check_int("l1_warmup_tokens", self.l1_warmup_tokens, low=0)
        check_float("decoder_init_norm", self.decoder_init_norm, strict=True)


class ReLUSAE(SparseAutoencoder):
    """z = ReLU((x - b_dec) W_enc + b_enc); loss ||x - x_hat||^2 + l1 sum_i z_i ||W_dec,i||."""

    Config = ReLUConfig
    method = "relu"
    unit_decoder = False
    config: ReLUConfig

    def _init_params(self, x: Tensor) -> dict[str, Tensor]:
        params = super()._init_params(x)
        W_dec = params["W_dec"] * self.config.decoder_init_norm
        return {**params, "W_dec": W_dec, "W_enc": W_dec.T.clone()}

    def _start(self, x: Tensor) -> None:
        """Also fix the L1's unit from the first batch (a rebuilt SAE too): the RMS spread
        sqrt(E||x - mean||^2 / d) of the normalised inputs."""
        super()._start(x)
        if "l1_unit" not in self.buffer_dict:
            spread = (x - x.mean(0)).pow(2).sum(1).mean() / x.shape[1]
            self.buffer_dict["l1_unit"] = spread.sqrt().float()

    def _activate(self, pre: Tensor, w: dict[str, Tensor], train: bool) -> Tensor:
        return pre.relu()

    def _penalty(self, x: Tensor, x_hat: Tensor, code: Code, w: dict[str, Tensor]) -> Tensor:
        return self.l1_now() * w["l1_unit"] * (code.z * w["W_dec"].norm(dim=1)).sum(-1).mean()

    def l1_now(self) -> float:
        """The L1 coefficient of the next step: `l1` scaled by the warm-up's progress."""
        ramp = self.config.l1_warmup_tokens
        return self.config.l1 * (min(1.0, self.trainer.running.tokens / ramp) if ramp else 1.0)
