"""MPSAE: matching pursuit as the encoder (Costa et al. 2025, "From flat to hierarchical").

    sae = MPSAE(width=4608, k=16, seed=0)

One tied dictionary of unit atoms W `(width, d)`. Encoding is k greedy steps on the residual
r = x - b_dec: pick the atom with the largest ReLU(r . W_j), add that value to z_j, remove it
from r (an atom may be picked more than once); x_hat = z W + b_dec. Training backpropagates
through the unrolled steps, as the released code (eval-HSAEs, MatchingPursuitSAE) does. Each
step is one (B, width, d) product, so a step costs about k times a TopK SAE's.
Matching pursuit is positively homogeneous in (x, b_dec), so the raw-space fold divides b_dec
by the input scale and leaves W alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from conceptlens.concepts.sae.base import Code, SparseAutoencoder
from conceptlens.concepts.sae.config import SAEConfig, check_int


@dataclass(kw_only=True)
class MPConfig(SAEConfig):
    """MPSAE hyper-parameters."""

    k: int
    """Matching-pursuit steps per token (at most k distinct atoms)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("k", self.k)


def matching_pursuit(r: Tensor, W: Tensor, k: int) -> Tensor:
    """k greedy steps: residual `(N, d)`, unit atoms `(width, d)` -> codes `(N, width)` (differentiable)."""
    z = r.new_zeros(r.shape[0], W.shape[0])
    rows = torch.arange(r.shape[0], device=r.device)
    for _ in range(k):
        values, index = (r @ W.T).relu().max(dim=1)  # (N,), (N,)
        z = z.index_put((rows, index), values, accumulate=True)
        r = r - values[:, None] * W[index]
    return z


class MPSAE(SparseAutoencoder):
    """z = MP_k(x - b_dec; W); x_hat = z W + b_dec; loss ||x - x_hat||^2 (no sparsity term: k sets it)."""

    Config = MPConfig
    method = "mpsae"
    config: MPConfig
    folded_by_scale = ("b_dec",)

    def _init_params(self, x: Tensor) -> dict[str, Tensor]:
        params = super()._init_params(x)
        return {"W_dec": params["W_dec"], "b_dec": params["b_dec"]}

    def _encode(self, x: Tensor, w: dict[str, Tensor], train: bool) -> Code:
        z = matching_pursuit(x - w["b_dec"], w["W_dec"], self.config.k)
        return Code(z, z)
