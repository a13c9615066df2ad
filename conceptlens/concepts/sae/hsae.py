"""HSAE: a two-level SAE, parents routing to subspace experts (Muchane et al. 2025).

    sae = HSAE(parents=64, children=8, subspace=8, k=8, seed=0)
    sae.tree()                        # [(parent, child latent), ...]: the architecture's hierarchy

Latents: `parents` top-level latents, then `children` per parent (child c of parent p is latent
parents + p * children + c). Encoding, after the released code (eval-HSAEs, MixtureOfExperts_v2):
- top level: a = E^T (x - b_dec) with an offset ReLU (a < offset -> 0, offset 1/sqrt(d)); keep
  the k largest (k = 32 in the paper);
- each kept parent p projects x - b_dec to its subspace u = W_down[p] (x - b_dec) `(subspace,)`,
  codes its children as e_p u with the same offset gate (leaky, slope 0.01, in training), and
  keeps only the largest child (k = 1 inside the expert), only if the parent fired;
- x_hat = b_dec + sum_p a_p D_p + sum_p c_p W_up[p] d_{p,c}: a linear decode by the composed
  directions (`concept_set` returns them: parents, then children in activation space).
Loss: ||x - x_hat||^2 + 0.1 ||x - x_hat_top||^2 + l1 (sum |a| + sum |child codes|) +
ortho * (off-diagonal Frobenius norm of the unit-encoder / unit-decoder cross-Gram) / (M^2 - M).
Differences from the released code: a learned b_dec (geometric-median start) like our other
SAEs; its cross-orthogonality subtracts the diagonal as a broadcast row (we take the
off-diagonal norm it describes); decoder rows are renormalised after each step without the
gradient projection; inference codes use the plain offset ReLU (no leak).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from conceptlens.concepts.sae.base import Code, SparseAutoencoder
from conceptlens.concepts.sae.config import SAEConfig, check_float, check_int


@dataclass(kw_only=True)
class HSAEConfig(SAEConfig):
    """HSAE hyper-parameters; `width` is parents * (1 + children) and need not be given."""

    width: int = 0
    parents: int
    children: int
    subspace: int
    """Dimension of each expert's subspace."""
    k: int = 32
    """Parents kept per token."""
    l1: float = 1e-3
    ortho: float = 1.0
    top_weight: float = 0.1
    """Weight of the parents-only reconstruction term."""
    leak: float = 0.01

    def __post_init__(self) -> None:
        for name in ("parents", "children", "subspace", "k"):
            check_int(name, getattr(self, name))
        want = self.parents * (1 + self.children)
        if self.width not in (0, want):
            raise ValueError(f"width must be parents * (1 + children) = {want}; got {self.width}")
        self.width = want
        super().__post_init__()
        if self.k > self.parents:
            raise ValueError(f"k must be at most parents={self.parents}; got k={self.k}")
        for name in ("l1", "ortho", "top_weight", "leak"):
            check_float(name, getattr(self, name))


def _unit_rows(w: Tensor, dim: int = -1) -> Tensor:
    return w / w.norm(dim=dim, keepdim=True).clamp(min=1e-12)


class HSAE(SparseAutoencoder):
    """Top-level TopK of offset-ReLU codes; one child (of `children`) per kept parent, in its subspace."""

    Config = HSAEConfig
    method = "hsae"
    config: HSAEConfig
    unit_decoder = False
    folded_by_scale = ("b_dec", "offset")

    def tree(self) -> list[tuple[int, int]]:
        """The architecture's parent -> child edges, as latent indices."""
        M, C = self.config.parents, self.config.children
        return [(p, M + p * C + c) for p in range(M) for c in range(C)]

    def _init_params(self, x: Tensor) -> dict[str, Tensor]:
        M, C, s, d = self.config.parents, self.config.children, self.config.subspace, x.shape[1]
        g = self.trainer.generator
        W_top = _unit_rows(torch.randn(M, d, generator=g))
        W_down = _unit_rows(torch.randn(M, s, d, generator=g))
        E_child = _unit_rows(torch.randn(M, C, s, generator=g))
        base = super()._init_params(x)
        self.buffer_dict = {"offset": torch.tensor(1 / math.sqrt(d)).to(self.tensor_device)}
        return {"W_enc": W_top.T.clone(), "W_top": W_top, "W_down": W_down, "W_up": W_down.transpose(1, 2).clone(),
                "E_child": E_child, "D_child": E_child.transpose(1, 2).clone(), "b_dec": base["b_dec"]}

    def _weights(self) -> dict[str, Tensor]:
        w = {**self.params, **self.buffer_dict}
        children = torch.einsum("mds,msc->mcd", w["W_up"], w["D_child"]).reshape(-1, w["W_top"].shape[1])
        return {**w, "W_dec": torch.cat([w["W_top"], children])}  # (width, d): the composed directions

    def _fold(self, w: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
        return {k: v / scale if k in self.folded_by_scale else v for k, v in w.items()}

    def _route(self, x: Tensor, w: dict[str, Tensor], train: bool) -> tuple[Tensor, ...]:
        M, C = self.config.parents, self.config.children
        xc = x - w["b_dec"]
        top = xc @ w["W_enc"]  # (N, M)
        top = top * (top >= w["offset"])
        values, idx = top.topk(self.config.k, dim=-1)  # (N, k)
        u = torch.einsum("nksd,nd->nks", w["W_down"][idx], xc)  # (N, k, s)
        pre = torch.einsum("nkcs,nks->nkc", w["E_child"][idx], u)  # (N, k, C)
        gated = torch.where(pre >= w["offset"], pre, pre * self.config.leak if train else torch.zeros_like(pre))
        best, which = gated.max(-1)  # (N, k): k = 1 inside each expert
        best = best * (values > 0)
        return top, values, idx, gated, best, which

    def _encode(self, x: Tensor, w: dict[str, Tensor], train: bool) -> Code:
        M, C = self.config.parents, self.config.children
        top, values, idx, gated, best, which = self._route(x, w, train)
        z = x.new_zeros(x.shape[0], self.config.width)
        z = z.scatter(1, idx, values).scatter(1, M + idx * C + which, best)
        if train:
            self._train_parts: tuple[Tensor, ...] = (top, gated, idx, values, which, best)
        return Code(z, z)

    def _decode(self, z: Tensor, w: dict[str, Tensor], train: bool = False) -> Tensor:
        if not train:
            return z @ w["W_dec"] + w["b_dec"]
        _, _, idx, values, which, best = self._train_parts
        M, C = self.config.parents, self.config.children
        index = torch.cat([idx, M + idx * C + which], dim=1)  # (N, 2k)
        weight = torch.cat([values, best], dim=1)
        return F.embedding_bag(index, w["W_dec"], per_sample_weights=weight, mode="sum") + w["b_dec"]

    def _penalty(self, x: Tensor, x_hat: Tensor, code: Code, w: dict[str, Tensor]) -> Tensor:
        top, gated, idx, values, _, _ = self._train_parts
        x_top = F.embedding_bag(idx, w["W_top"], per_sample_weights=values, mode="sum") + w["b_dec"]
        l1 = (top.abs().sum() + gated.abs().sum()) / x.shape[0]
        E, D = _unit_rows(w["W_enc"], dim=0), _unit_rows(w["W_top"])
        cross = D @ E  # (M, M)
        M = cross.shape[0]
        off = (cross - torch.diag(torch.diagonal(cross))).norm() / max(M * M - M, 1)
        return (self.config.top_weight * (x - x_top).pow(2).sum(-1).mean() + self.config.l1 * l1
                + self.config.ortho * off)

    def _after_step(self, code: Code) -> None:
        self._train_parts = ()

    def _constrain(self) -> None:
        W_top, D_child = self.params["W_top"], self.params["D_child"]  # (inside no_grad)
        W_top /= W_top.norm(dim=-1, keepdim=True).clamp(min=1e-12)
        D_child /= D_child.norm(dim=1, keepdim=True).clamp(min=1e-12)
