"""The active pre-activations of a sparse code, with a backward that touches only them.

    with torch.no_grad():
        pre = (x - b_dec) @ W_enc + b_enc                 # (B, width): selection only, no graph
    values, indices = pre.topk(k, dim=-1, sorted=False)  # (B, k)
    values = active_pre(pre, indices, x, w)               # (B, k), differentiable in b_dec, W_enc, b_enc

A TopK code keeps k of `width` pre-activations per row, so all but B k entries of the dense
product's gradient are zero; its backward (x^T @ grad_pre) still costs O(B width d), as much as
the forward. Here the encoder weights' gradient is a sparse-dense product over the B k active
entries, O(B k d): the same gradient up to float summation order. On CPU only: on a GPU the
dense product is cheap and the sparse one would read its size back to the host.
"""

from __future__ import annotations

import torch
from torch import Tensor


class _ActivePre(torch.autograd.Function):
    """pre.gather(1, indices) for pre = (x - b_dec) W_enc + b_enc, x without a gradient."""

    @staticmethod
    def forward(ctx, pre: Tensor, x: Tensor, b_dec: Tensor, W_enc: Tensor, b_enc: Tensor,  # type: ignore[override]
                indices: Tensor) -> Tensor:
        ctx.save_for_backward(x, b_dec, W_enc, indices)
        return pre.gather(1, indices)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        x, b_dec, W_enc, indices = ctx.saved_tensors
        (n, k), (d, width) = indices.shape, W_enc.shape
        dtype = torch.promote_types(W_enc.dtype, torch.float32)  # bfloat16 weights: float32 sums
        g = grad.to(dtype)  # (B, k)
        flat = indices.flatten()  # (B k,)
        g_b_enc = g.new_zeros(width).index_add_(0, flat, g.flatten())  # (width,)
        g_W_enc = None
        if ctx.needs_input_grad[3]:
            rows = torch.arange(n, device=x.device).repeat_interleave(k)  # (B k,)
            # (width, B) with B k nonzeros, times the centred rows (B, d): (width, d)
            sparse = torch.sparse_coo_tensor(torch.stack([flat, rows]), g.flatten(), (width, n),
                                             check_invariants=False)  # unique (latent, row) pairs by construction
            g_W_enc = torch.sparse.mm(sparse, (x - b_dec).to(dtype)).T.to(W_enc.dtype)  # (d, width)
        # d pre / d b_dec = -W_enc for every row: the rows' sum is -W_enc @ (grad summed per latent)
        g_b_dec = -(W_enc.to(dtype) @ g_b_enc) if ctx.needs_input_grad[2] else None  # (d,)
        return (None, None, None if g_b_dec is None else g_b_dec.to(b_dec.dtype), g_W_enc,
                g_b_enc.to(W_enc.dtype) if ctx.needs_input_grad[4] else None, None)


def sparse_backward(x: Tensor) -> bool:
    """Whether the encoder's backward goes through `active_pre` for rows on x's device."""
    return x.device.type == "cpu"


def active_pre(pre: Tensor, indices: Tensor, x: Tensor, w: dict[str, Tensor]) -> Tensor:
    """`pre.gather(1, indices)` `(B, k)`, differentiable in w's b_dec, W_enc and b_enc; `pre`
    `(B, width)` was computed from x `(B, d)` and w without a graph (else it is just the gather)."""
    if pre.requires_grad:
        return pre.gather(1, indices)
    return _ActivePre.apply(pre, x, w["b_dec"], w["W_enc"], w["b_enc"], indices)
