"""ReLUSAE: the standard SAE, ReLU gate and an L1 penalty weighted by decoder norms.

    sae = ReLUSAE(width=4608, l1=5.0, seed=0)

The penalty is l1 * sum_i z_i ||W_dec,i|| (Anthropic's April 2024 update), which cannot be
lowered by shrinking latents while growing decoder rows.
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

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float("l1", self.l1)


class ReLUSAE(SparseAutoencoder):
    """z = ReLU((x - b_dec) W_enc + b_enc); loss ||x - x_hat||^2 + l1 sum_i z_i ||W_dec,i||."""

    Config = ReLUConfig
    method = "relu_sae"
    config: ReLUConfig

    def _activate(self, pre: Tensor, w: dict[str, Tensor], train: bool) -> Tensor:
        return pre.relu()

    def _penalty(self, x: Tensor, x_hat: Tensor, code: Code, w: dict[str, Tensor]) -> Tensor:
        return self.config.l1 * (code.z * w["W_dec"].norm(dim=1)).sum(-1).mean()
