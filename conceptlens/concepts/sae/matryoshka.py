"""MatryoshkaSAE: nested prefixes of one dictionary each reconstruct the input.

    sae = MatryoshkaSAE(width=4608, k=32, prefixes=(576, 1152, 2304, 4608), seed=0)

This is the dictionary-nested Matryoshka of the hierarchy comparison (Grandien et al. 2026
call it ArchMSAE; `ArchMSAE` is an alias). The activation-nested one that builds deeper
hierarchies there is `ActMSAE` (conceptlens.concepts.sae.nested).

Latents are ordered: the first m of them must reconstruct x on their own for every prefix
size m, so early latents learn general concepts and later ones refine them instead of
absorbing them (Bussmann et al. 2025, Nabeshima 2024). Encoding is TopK on the full width;
only the reconstruction loss changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from conceptlens.concepts.sae.active import Active, prefix_losses
from conceptlens.concepts.sae.base import Code
from conceptlens.concepts.sae.topk import TopKConfig, TopKSAE


@dataclass(kw_only=True)
class MatryoshkaConfig(TopKConfig):
    """MatryoshkaSAE hyper-parameters."""

    prefixes: tuple[int, ...] | None = None
    """Increasing prefix sizes ending at width; None means width/8, width/4, width/2, width."""
    prefix_weights: tuple[float, ...] | None = None
    """Weight of each prefix's reconstruction loss; None means 1 for each."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prefixes is None:
            self.prefixes = tuple(sorted({max(self.width // 2**i, 1) for i in range(4)}))
        sizes = tuple(self.prefixes) if isinstance(self.prefixes, (list, tuple)) else ()
        if (not sizes or any(isinstance(m, bool) or not isinstance(m, int) for m in sizes)
                or any(a >= b for a, b in zip(sizes, sizes[1:])) or sizes[0] < 1 or sizes[-1] != self.width):
            raise ValueError(f"prefixes must be strictly increasing ints >= 1 ending at width={self.width}; "
                             f"got {self.prefixes!r}")
        self.prefixes = sizes
        if self.prefix_weights is None:
            self.prefix_weights = (1.0,) * len(sizes)
        weights = tuple(float(v) for v in self.prefix_weights)
        if len(weights) != len(sizes) or any(not v >= 0 for v in weights):
            raise ValueError(f"prefix_weights must be {len(sizes)} numbers >= 0, one per prefix; "
                             f"got {self.prefix_weights!r}")
        self.prefix_weights = weights

    def levels(self) -> list[tuple[int, float]]:
        """(prefix size, loss weight) of each prefix, as resolved on creation."""
        if self.prefixes is None or self.prefix_weights is None:  # (__post_init__ fills both)
            raise ValueError("a MatryoshkaConfig's prefixes are resolved on creation")
        return list(zip(self.prefixes, self.prefix_weights))


class MatryoshkaSAE(TopKSAE):
    """TopK encoding; loss sum_m weight_m ||x - (z[:, :m] W_dec[:m] + b_dec)||^2 + AuxK."""

    Config = MatryoshkaConfig
    method = "matryoshka"
    config: MatryoshkaConfig

    def _recon_loss(self, x: Tensor, code: Code, x_hat: Tensor, w: dict[str, Tensor]) -> Tensor:
        levels = self.config.levels()
        prefixes, weights = [m for m, _ in levels], [v for _, v in levels]
        if code.active is not None:  # each prefix decodes its own active latents: O(B k d) each
            return prefix_losses(x, x_hat, code.active, w["W_dec"], w["b_dec"], prefixes, weights)
        if not self.at_most_k_in_training:
            return self._dense_prefix_loss(x, code.z, w)
        # Training codes have at most k nonzeros per row: the same gather, after a top-k of z
        values, indices = code.z.topk(self.config.k, dim=-1, sorted=False)  # (B, k): every nonzero
        offsets = torch.arange(0, values.numel(), self.config.k, device=x.device)  # (B,)
        active = Active(values.flatten(), indices.flatten(), offsets)
        return prefix_losses(x, x_hat, active, w["W_dec"], w["b_dec"], prefixes, weights)

    def _dense_prefix_loss(self, x: Tensor, z: Tensor, w: dict[str, Tensor]) -> Tensor:
        # Each prefix's reconstruction adds the next block of latents to the previous one,
        # so all prefixes together cost one full dense decode.
        partial = w["b_dec"].expand_as(x)  # (B, d)
        loss, start = x.new_zeros(()), 0
        for stop, weight in self.config.levels():
            partial = partial + z[:, start:stop] @ w["W_dec"][start:stop]
            loss = loss + weight * (x - partial).pow(2).sum(-1).mean()
            start = stop
        return loss


ArchMSAE = MatryoshkaSAE
"""The name of the dictionary-nested Matryoshka in the hierarchy comparison (002)."""
