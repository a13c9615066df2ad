"""Hierarchical SAEs of the Grandien et al. (2026) comparison: ActMSAE and EWG-SAE.

    sae = ActMSAE(width=4608, k=64, ks=(64, 256, 1024, 4608), seed=0)    # activation-nested
    sae = EWGSAE(width=4608, groups=(288, 864, 2016, 4608), l1=1.0)       # grouped weighted L1

- ActMSAE (Zaigrajew et al. 2025, "activation Matryoshka"): one dictionary and one encoder;
  the TopK codes at nested sparsities k_1 < ... < k_m each reconstruct x, with weights
  alpha_1 >= ... >= alpha_m (the paper: k in {64 .. 6144}, alpha = 8 .. 1), so the first
  few latents of every token carry the coarse part of it. `encode` keeps the `encode_k`
  largest (default k = k_1; the graph protocol reads each sample's top 64). Our `MatryoshkaSAE`
  nests the dictionary instead (the paper's ArchMSAE; alias `ArchMSAE`).
- EWG-SAE: a ReLU SAE whose L1 penalty (normalised by ||x||, as in the released code) is
  summed per group of latents (groups = cumulative end indices) with exponential weights
  0.5^(G-1-g), normalised to sum 1: earlier, smaller groups are penalised least.
Differences from the released code (eval-HSAEs): no tanh soft cap on latents (it caps at 30,
far above our normalised activations); the TopK family keeps its AuxK term for dead latents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from conceptlens.concepts.sae.base import Code, SparseAutoencoder
from conceptlens.concepts.sae.config import SAEConfig, check_float, check_int
from conceptlens.concepts.sae.topk import TopKConfig, TopKSAE, topk_relu


def _increasing(name: str, sizes: tuple[int, ...], last: int, first: int | None = None) -> tuple[int, ...]:
    sizes = tuple(sizes)
    ok = (sizes and all(isinstance(m, int) and not isinstance(m, bool) for m in sizes)
          and all(a < b for a, b in zip(sizes, sizes[1:])) and sizes[0] >= 1 and sizes[-1] <= last)
    if not ok or (first is not None and sizes[0] != first):
        start = f" starting at k={first}" if first is not None else ""
        raise ValueError(f"{name} must be strictly increasing ints >= 1{start}, at most {last}; got {sizes!r}")
    return sizes


def _weights(name: str, weights: tuple[float, ...] | None, n: int, default: tuple[float, ...]) -> tuple[float, ...]:
    weights = default if weights is None else tuple(float(v) for v in weights)
    if len(weights) != n or any(not v >= 0 for v in weights) or sum(weights) <= 0:
        raise ValueError(f"{name} must be {n} numbers >= 0 (not all 0), one per level; got {weights!r}")
    return weights


@dataclass(kw_only=True)
class ActMSAEConfig(TopKConfig):
    """ActMSAE hyper-parameters: `k` is the sparsest level (the one `encode` keeps)."""

    ks: tuple[int, ...] | None = None
    """Nested sparsities k_1 = k < ... <= width; None means k, 4k, 16k, ... up to width."""
    k_weights: tuple[float, ...] | None = None
    """Loss weight of each level; None means m, m - 1, ..., 1 (the paper's 8 .. 1 for 8 levels)."""
    encode_k: int | None = None
    """Latents `encode` keeps per token; None means k. The paper reads all ReLU'd latents and
    keeps each sample's top 64 for its graphs: encode_k=64 gives the same codes."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ks is None:
            ks, k = [], self.k
            while k < self.width:
                ks.append(k)
                k *= 4
            self.ks = tuple(ks) + (self.width,)
        self.ks = _increasing("ks", self.ks, self.width, first=self.k)
        if self.encode_k is not None:
            check_int("encode_k", self.encode_k)
            if self.encode_k > self.width:
                raise ValueError(f"encode_k must be at most width={self.width}; got {self.encode_k}")
        m = len(self.ks)
        self.k_weights = _weights("k_weights", self.k_weights, m, tuple(float(m - i) for i in range(m)))

    def levels(self) -> list[tuple[int, float]]:
        """(k, loss weight) of each level, as resolved on creation."""
        if self.ks is None or self.k_weights is None:  # (__post_init__ fills both)
            raise ValueError("an ActMSAEConfig's levels are resolved on creation")
        return list(zip(self.ks, self.k_weights))


class ActMSAE(TopKSAE):
    """Encoder TopK at k; loss sum_m alpha_m ||x - (TopK_{k_m}(pre) W_dec + b_dec)||^2 + AuxK."""

    Config = ActMSAEConfig
    method = "actmsae"
    config: ActMSAEConfig

    def _activate(self, pre: Tensor, w: dict[str, Tensor], train: bool) -> Tensor:
        return topk_relu(pre, self.config.k if train else self.config.encode_k or self.config.k)

    def _recon_loss(self, x: Tensor, code: Code, x_hat: Tensor, w: dict[str, Tensor]) -> Tensor:
        # One sort of the pre-activations; level m adds the latents ranked k_{m-1} .. k_m.
        pre = (x.to(w["W_enc"].dtype) - w["b_dec"]) @ w["W_enc"] + w["b_enc"]  # (B, width), as in _encode
        levels = self.config.levels()
        values, indices = pre.topk(levels[-1][0], dim=-1, sorted=True)  # (B, k_m)
        values = values.relu()
        partial, start = w["b_dec"].expand_as(x), 0
        loss = x.new_zeros(())
        for stop, weight in levels:
            partial = partial + F.embedding_bag(indices[:, start:stop], w["W_dec"],
                                                per_sample_weights=values[:, start:stop], mode="sum")
            loss = loss + weight * (x - partial).pow(2).sum(-1).mean()
            start = stop
        return loss


@dataclass(kw_only=True)
class EWGConfig(SAEConfig):
    """EWG-SAE hyper-parameters."""

    groups: tuple[int, ...] | None = None
    """Cumulative end index of each latent group, ending at width; None means width/8, /4, /2, width."""
    l1: float = 1.0
    """Weight of the group-weighted, ||x||-normalised L1 penalty."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float("l1", self.l1)
        if self.groups is None:
            self.groups = tuple(sorted({max(self.width // 2**i, 1) for i in range(4)}))
        self.groups = _increasing("groups", self.groups, self.width)
        if self.groups[-1] != self.width:
            raise ValueError(f"groups must end at width={self.width}; got {self.groups!r}")

    def group_ends(self) -> tuple[int, ...]:
        """The cumulative end index of each group, as resolved on creation."""
        if self.groups is None:  # (__post_init__ fills it)
            raise ValueError("an EWGConfig's groups are resolved on creation")
        return self.groups


class EWGSAE(SparseAutoencoder):
    """z = ReLU((x - b_dec) W_enc + b_enc); loss ||x - x_hat||^2 + l1 sum_g w_g mean(|z_g|_1 / |x|)."""

    Config = EWGConfig
    method = "ewg"
    config: EWGConfig

    def _activate(self, pre: Tensor, w: dict[str, Tensor], train: bool) -> Tensor:
        return pre.relu()

    def group_weights(self) -> Tensor:
        """`(G,)`: 0.5^(G-1-g) / sum, the last (largest-index) group weighted most."""
        g = len(self.config.group_ends())
        raw = torch.tensor([0.5 ** (g - 1 - i) for i in range(g)], dtype=torch.float64)
        return (raw / raw.sum()).float()

    def _penalty(self, x: Tensor, x_hat: Tensor, code: Code, w: dict[str, Tensor]) -> Tensor:
        norm = x.norm(dim=-1).clamp(min=1e-12)  # (B,)
        ends = self.config.group_ends()
        starts = (0,) + ends[:-1]
        per_group = torch.stack([(code.z[:, a:b].abs().sum(-1) / norm).mean() for a, b in zip(starts, ends)])
        return self.config.l1 * (per_group * self.group_weights().to(x.device)).sum()
