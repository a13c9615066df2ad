"""sparsemax: the Euclidean projection onto the probability simplex, with exact zeros.

    p = sparsemax(scores)            # scores (..., n) -> p (..., n), p >= 0, p.sum(-1) == 1

Martins & Astudillo (2016), "From Softmax to Sparsemax". Unlike softmax, low scores get
exactly zero probability, which is what makes SpaDE's codes sparse.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _threshold(z: Tensor) -> Tensor:
    """tau `(..., 1)` such that `clamp(z - tau, min=0)` sums to one along the last dimension.

    Sorting z descending, the support is the largest k with `1 + k z_(k) > sum_{j<=k} z_(j)`
    (the condition holds for a prefix of k), and tau = (sum of the support - 1) / k.
    """
    z_sorted = z.sort(dim=-1, descending=True).values  # (..., n)
    cumsum = z_sorted.cumsum(dim=-1)  # (..., n)
    ks = torch.arange(1, z.shape[-1] + 1, device=z.device, dtype=z.dtype)  # (n,)
    in_support = 1 + ks * z_sorted > cumsum  # (..., n), True on a prefix
    k = in_support.sum(dim=-1, keepdim=True)  # (..., 1), >= 1 always
    return (cumsum.gather(-1, k - 1) - 1) / k.to(z.dtype)


class _Sparsemax(torch.autograd.Function):
    """sparsemax over the last dimension, with the closed-form Jacobian-vector product.

    On the support S the Jacobian is I - 1 1^T / |S|; off the support it is zero. So the
    input gradient is `g - mean_S(g)` on S and 0 elsewhere.
    """

    @staticmethod
    def forward(ctx: Any, z: Tensor) -> Tensor:
        p = (z - _threshold(z)).clamp(min=0)
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (p,) = ctx.saved_tensors
        support = (p > 0).to(grad.dtype)  # (..., n)
        mean_on_support = (grad * support).sum(-1, keepdim=True) / support.sum(-1, keepdim=True)
        return support * (grad - mean_on_support)


def sparsemax(z: Tensor, dim: int = -1) -> Tensor:
    """Project `z` onto the probability simplex along `dim` (differentiable).

    `sparsemax(z) = argmin_{p >= 0, sum p = 1} ||p - z||^2`. Same shape as `z`.
    """
    if not z.is_floating_point():
        raise TypeError(f"sparsemax needs a floating-point tensor; got dtype {z.dtype}")
    if z.ndim == 0:
        raise ValueError("sparsemax needs at least one dimension to project along")
    moved = z.movedim(dim, -1)
    return _Sparsemax.apply(moved).movedim(-1, dim)
