"""Kernels for an SAE training step that gathers its active latents, kept apart from the SAE
classes so that a trainer can call them.

    loss = prefix_losses(x, x_hat, active, W_dec, b_dec, prefixes, weights)   # Matryoshka's loss

Pure functions on tensors, tested against the dense computations they replace.
"""

from __future__ import annotations

from typing import Sequence

import torch.nn.functional as F
from torch import Tensor

from conceptlens.concepts.sae.active import Active


def prefix_losses(x: Tensor, x_hat: Tensor, active: Active, W_dec: Tensor, b_dec: Tensor,
                  prefixes: Sequence[int], weights: Sequence[float]) -> Tensor:
    """sum_m weight_m * mean_rows ||x - (z[:, :m] @ W_dec[:m] + b_dec)||^2 over the prefix sizes m,
    from the code's active latents `(M,)` alone (values, latents and row offsets, as the TopK step
    gathers them): each prefix decodes its own active latents, O(M d), with no dense `(B, width)`
    code and no top-k over it. `x_hat` is the full-width reconstruction (the last prefix)."""
    loss = x.new_zeros(())
    width = prefixes[-1]
    for stop, weight in zip(prefixes, weights):
        if stop == width:
            recon = x_hat
        else:
            inside = active.values * (active.latents < stop)  # latents past the prefix weigh 0
            recon = F.embedding_bag(active.latents, W_dec, active.offsets, mode="sum",
                                    per_sample_weights=inside) + b_dec
        loss = loss + weight * (x - recon).pow(2).sum(-1).mean()
    return loss
