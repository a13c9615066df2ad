"""JumpReLUSAE: a per-latent threshold trained through an L0 penalty (Rajamanoharan et al. 2024).

    sae = JumpReLUSAE(width=4608, l0=1.0, seed=0)

z = pre * H(pre - theta), theta = exp(log_theta). The step H has zero gradient almost
everywhere, so theta learns from a straight-through estimator: a rectangle kernel of width
`bandwidth` around the threshold stands in for the Dirac delta.

Defaults differ from the paper's (threshold 1e-3, bandwidth 1e-3, for runs of 100k+ steps) and
from SAELens's (0.01, 0.05 on raw inputs). Adam moves log(theta) by about lr per step, so in a
short streaming fit theta stays near its start (SmolLM2 block 15, width 2304, 12 steps of 4096:
threshold 0.1 -> 0.1006, L0 980); what the start means depends on how much of the input's norm is
its mean. Both are therefore given in spread units: s = sqrt(E||x - mean||^2 / d) of the first
normalised batch (as ReLUSAE's l1), theta_0 = threshold_init * s and kernel width bandwidth * s.
A random unit encoder row gives pre-activations of spread ~s, so theta_0 = 1.5 s starts about 7%
of the latents firing; the default gives L0 84 of 2304 after those 12 steps (FVU 0.61) and L0
2.6 of 128 on a planted dictionary with 3 active atoms (all recovered, held-out FVU 0.16). Pass
`threshold_init` / `bandwidth` for other starts (the paper's 1e-3 is ~1.5e-3 s on SmolLM2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from conceptlens.concepts.sae.active import Active, active_pre, entry_rows, sparse_backward
from conceptlens.concepts.sae.base import Code, SparseAutoencoder
from conceptlens.concepts.sae.config import SAEConfig, check_float


def _rectangle(u: Tensor) -> Tensor:
    """1 on (-1/2, 1/2), 0 outside."""
    return ((u > -0.5) & (u < 0.5)).to(u.dtype)


class JumpReLUFunction(torch.autograd.Function):
    """pre * H(pre - theta); d/dpre = H(pre - theta), d/dtheta = -(theta / eps) K((pre - theta) / eps)."""

    @staticmethod
    def forward(ctx: Any, pre: Tensor, theta: Tensor, bandwidth: float) -> Tensor:
        ctx.save_for_backward(pre, theta)
        ctx.bandwidth = bandwidth
        return pre * (pre > theta)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        pre, theta = ctx.saved_tensors
        eps = ctx.bandwidth
        grad_pre = (pre > theta).to(grad.dtype) * grad
        grad_theta = -(theta / eps) * _rectangle((pre - theta) / eps) * grad
        return grad_pre, grad_theta.sum_to_size(theta.shape), None


class StepFunction(torch.autograd.Function):
    """H(pre - theta); d/dpre = 0, d/dtheta = -(1 / eps) K((pre - theta) / eps)."""

    @staticmethod
    def forward(ctx: Any, pre: Tensor, theta: Tensor, bandwidth: float) -> Tensor:
        ctx.save_for_backward(pre, theta)
        ctx.bandwidth = bandwidth
        return (pre > theta).to(pre.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None]:
        pre, theta = ctx.saved_tensors
        eps = ctx.bandwidth
        grad_theta = -(1 / eps) * _rectangle((pre - theta) / eps) * grad
        return None, grad_theta.sum_to_size(theta.shape), None


@dataclass(kw_only=True)
class JumpReLUConfig(SAEConfig):
    """JumpReLUSAE hyper-parameters (threshold and bandwidth in spread units; see the module docstring)."""

    l0: float = 1.0
    """Weight of the L0 penalty (expected active latents per token)."""
    bandwidth: float = 0.2
    """Width of the rectangle kernel of the straight-through estimator, in spread units."""
    threshold_init: float = 1.5
    """Initial threshold of every latent, in spread units of the first batch."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float("l0", self.l0)
        check_float("bandwidth", self.bandwidth, strict=True)
        check_float("threshold_init", self.threshold_init, strict=True)


class JumpReLUSAE(SparseAutoencoder):
    """z = JumpReLU_theta((x - b_dec) W_enc + b_enc); loss ||x - x_hat||^2 + l0 * ||z||_0."""

    Config = JumpReLUConfig
    method = "jumprelu"
    config: JumpReLUConfig

    def _init_params(self, x: Tensor) -> dict[str, Tensor]:
        """Thresholds start at `threshold_init` spread units of the first normalised batch `x` (1 when
        its rows do not vary: one row, or copies of one; the rows are scaled to E||x||^2 = d)."""
        spread = ((x - x.mean(0)).pow(2).sum(1).mean() / x.shape[1]).sqrt().float()  # RMS spread per feature
        spread = torch.where(spread > 0, spread, torch.ones_like(spread))
        self.buffer_dict = {"spread": spread}
        log_theta = torch.full((self.config.width,), math.log(self.config.threshold_init * float(spread)))
        return {**super()._init_params(x), "log_threshold": log_theta}

    def _bandwidth(self) -> Tensor | float:
        """The kernel's width in the normalised space: `bandwidth` spread units (a 0-dim tensor on
        the device, so no host read per step; a set restored for inference has no spread)."""
        spread = self.buffer_dict.get("spread")
        return self.config.bandwidth * (1.0 if spread is None else spread)

    def _weights(self) -> dict[str, Tensor]:
        return {**self.params, "threshold": self.params["log_threshold"].exp()}

    def _activate(self, pre: Tensor, w: dict[str, Tensor], train: bool) -> Tensor:
        return JumpReLUFunction.apply(pre, w["threshold"], self._bandwidth())

    def _encode(self, x: Tensor, w: dict[str, Tensor], train: bool) -> Code:
        """In training on CPU, the code of the entries the step's gradients touch: the active ones
        (pre > theta) and, for the threshold's straight-through estimator, those within half a
        bandwidth of it (value 0 when below). The dense product only selects them; the encoder's
        backward and the decode touch only them (`sae/active.py`), and each gets JumpReLU's value
        and gradients, so the step's gradients are the dense step's up to summation order."""
        if not (train and sparse_backward(x)):
            return super()._encode(x, w, train)
        theta, eps = w["threshold"], self._bandwidth()
        with torch.no_grad():
            pre = torch.addmm(w["b_enc"], x - w["b_dec"], w["W_enc"])  # (B, width)
            touched = (pre > theta) | ((pre - theta).abs() < eps / 2)
            rows, latents = touched.nonzero(as_tuple=True)  # (M,) each, grouped by row
            offsets = torch.searchsorted(rows, torch.arange(pre.shape[0], device=rows.device))  # (B,)
        values = JumpReLUFunction.apply(active_pre(pre, rows, latents, x, w), theta[latents], eps)  # (M,)
        return Code(None, pre, Active(values, latents, offsets))

    def _penalty(self, x: Tensor, x_hat: Tensor, code: Code, w: dict[str, Tensor]) -> Tensor:
        theta, eps = w["threshold"], self._bandwidth()
        if code.active is None:
            active = StepFunction.apply(code.pre, theta, eps)  # (B, width)
            return self.config.l0 * active.sum(-1).mean()
        a = code.active  # every active entry and every one the kernel reaches: the rest add 0, value and gradient
        pre = code.pre[entry_rows(a.offsets, len(a.latents)), a.latents]  # (M,)
        return self.config.l0 * StepFunction.apply(pre, theta[a.latents], eps).sum() / code.pre.shape[0]
