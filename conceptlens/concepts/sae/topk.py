"""TopKSAE: keep the k largest pre-activations of each token (Gao et al. 2024).

    sae = TopKSAE(width=4608, k=32, seed=0)

Sparsity is set by k, so the loss has no sparsity term; the AuxK term makes the k_aux
largest pre-activations of dead latents reconstruct the main reconstruction's residual,
which revives them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from conceptlens.concepts.sae.active import Active, active_decode, active_pre, row_major, sparse_backward
from conceptlens.concepts.sae.base import Code, SparseAutoencoder
from conceptlens.concepts.sae.config import SAEConfig, check_float, check_int


@dataclass(kw_only=True)
class TopKConfig(SAEConfig):
    """TopKSAE hyper-parameters."""

    k: int
    """Active latents per token."""
    k_aux: int | None = None
    """Dead latents used by the AuxK term; None means d // 2."""
    aux_coef: float = 1 / 32
    """Weight of the AuxK term."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("k", self.k)
        if self.k > self.width:
            raise ValueError(f"k must be at most width={self.width}; got k={self.k}")
        if self.k_aux is not None:
            check_int("k_aux", self.k_aux)
        check_float("aux_coef", self.aux_coef)


def topk_relu(pre: Tensor, k: int) -> Tensor:
    """Keep the k largest entries of each row of `pre` `(N, width)`, ReLU them, zero the rest."""
    values, indices = pre.topk(k, dim=-1, sorted=False)  # (N, k)
    return torch.zeros_like(pre).scatter(-1, indices, values.relu())


def sparse_decode(z: Tensor, k: int, W_dec: Tensor) -> Tensor:
    """`z @ W_dec` for z `(N, width)` with at most k nonzeros per row, as a gather-and-sum.

    O(N k d) instead of O(N width d), forward and backward (the dense product's backward
    also multiplies by the full decoder).
    """
    values, indices = z.topk(k, dim=-1, sorted=False)  # (N, k): every nonzero, padded with zeros
    return F.embedding_bag(indices, W_dec, per_sample_weights=values, mode="sum")  # (N, d)


class TopKSAE(SparseAutoencoder):
    """z = ReLU(TopK((x - b_dec) W_enc + b_enc)); loss ||x - x_hat||^2 + AuxK."""

    Config = TopKConfig
    method = "topk"
    config: TopKConfig
    at_most_k_in_training: ClassVar[bool] = True
    """Whether training codes have at most k nonzeros per row (so the decode can gather)."""
    sparse_training: ClassVar[bool] = True
    """Whether training codes are the ReLU'd pre-activations `_select` picks: on CPU the
    encoder's backward touches only those, and the decode gathers their decoder rows."""

    def _select(self, pre: Tensor) -> tuple[Tensor, Tensor]:
        """The training gate's picks in `pre` `(B, width)`: (rows, latents), grouped by row."""
        return row_major(pre.topk(self.config.k, dim=-1, sorted=False).indices)  # (B k,) each

    def _encode(self, x: Tensor, w: dict[str, Tensor], train: bool) -> Code:
        if not (train and self.sparse_training and sparse_backward(x)):
            return super()._encode(x, w, train)
        with torch.no_grad():  # the dense product only selects; the gradient flows through active_pre
            pre = torch.addmm(w["b_enc"], x - w["b_dec"], w["W_enc"])  # (B, width), the bias added in the product
            rows, latents = self._select(pre)  # (M,) each
            offsets = torch.searchsorted(rows, torch.arange(pre.shape[0], device=rows.device))  # (B,)
        values = active_pre(pre, rows, latents, x, w).relu()  # (M,)
        return Code(None, pre, Active(values, latents, offsets))  # the dense z only if something reads it

    def _activate(self, pre: Tensor, w: dict[str, Tensor], train: bool) -> Tensor:
        return topk_relu(pre, self.config.k)

    def _decode(self, z: Tensor, w: dict[str, Tensor], train: bool = False) -> Tensor:
        # In training z has at most k nonzeros per row; latents passed to decode() may have
        # more (a clamped latent), so they take the dense product.
        if train and self.at_most_k_in_training:
            return sparse_decode(z, self.config.k, w["W_dec"]) + w["b_dec"]
        return super()._decode(z, w)

    def _penalty(self, x: Tensor, x_hat: Tensor, code: Code, w: dict[str, Tensor]) -> Tensor:
        """AuxK: alpha * ||e - e_hat||^2 / Var(e), in units of the main loss (times Var(x) / B).

        As in Gao et al. the term is normalised by the residual's variance, so its weight
        does not fade as the main reconstruction improves.
        """
        tracker = self.trainer.tracker
        if self.config.aux_coef == 0 or tracker.none_dead():  # decided on the host: no device read
            return x.new_zeros(())
        if self.trainer.running.steps % 256 == 0:
            tracker.refresh()  # one device read every 256 steps lets the fast path come back
        dead = tracker.dead()  # (width,)
        # k_aux fixed on the host; live latents enter as -inf and get weight relu(-inf) = 0, so
        # fewer dead latents than k_aux give the same e_hat as a top-n_dead would
        k_aux = min(self.config.k_aux or max(x.shape[1] // 2, 1), self.config.width)
        e = (x - x_hat).detach()  # (B, d): the residual the dead latents should explain
        values, indices = code.pre.masked_fill(~dead, float("-inf")).topk(k_aux, dim=-1, sorted=False)
        live = values == float("-inf")  # (B, k_aux): picked only to fill k_aux; weight 0
        weights = active_pre(code.pre, *row_major(indices), x.to(code.pre.dtype), w).view_as(values)
        weights = weights.masked_fill(live, 0).relu()
        starts = torch.arange(0, indices.numel(), k_aux, device=indices.device)  # (B,) k_aux per row
        e_hat = active_decode(indices.flatten(), weights.flatten(), starts, w["W_dec"])  # (B, d)
        var_e = (e - e.mean(0)).pow(2).sum().clamp(min=1e-12)
        var_x = (x - x.mean(0)).pow(2).sum()
        term = self.config.aux_coef * (e - e_hat).pow(2).sum() / var_e * var_x / x.shape[0]
        return torch.where(dead.any(), term, term.new_zeros(()))  # exactly 0 when none is dead
