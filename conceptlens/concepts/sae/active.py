"""The active latents of a sparse training code, with an encoder backward that touches only them.

    with torch.no_grad():
        pre = (x - b_dec) @ W_enc + b_enc                 # (B, width): selection only, no graph
    rows, latents = row_major(pre.topk(k, dim=-1).indices)  # (B k,) each, grouped by row
    values = active_pre(pre, rows, latents, x, w)         # (B k,), differentiable in b_dec, W_enc, b_enc
    loss = prefix_losses(x, x_hat, Active(values, latents, offsets), W_dec, b_dec, prefixes, weights)  # Matryoshka

A TopK code keeps k of `width` pre-activations per row (a batch top-k, k B of the batch), so all
but those entries of the dense product's gradient are zero; its backward (x^T @ grad_pre) still
costs O(B width d), as much as the forward. Here the encoder weights' gradient is a sparse-dense
product over the active entries, O(B k d): the same gradient up to float summation order. On CPU
only: on a GPU the dense product is cheap and the sparse one would read its size back to the host.
A JumpReLU code gathers its active entries and those within half a bandwidth of their threshold
(value 0), whose gradient the thresholds' straight-through estimator reads (`sae/jumprelu.py`).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


class Active(NamedTuple):
    """The nonzero latents of a training code, row after row: what the decode gathers."""

    values: Tensor
    """(M,) activations, differentiable."""
    latents: Tensor
    """(M,) latent of each value."""
    offsets: Tensor
    """(N,) where each row's entries start (`F.embedding_bag`'s offsets)."""

    def dense(self, like: Tensor) -> Tensor:
        """The code as a dense tensor shaped like `like` `(N, width)`, differentiable in `values`."""
        rows = entry_rows(self.offsets, len(self.values))  # (M,)
        return torch.zeros_like(like).index_put((rows, self.latents), self.values)


class _ActivePre(torch.autograd.Function):
    """pre[rows, latents] for pre = (x - b_dec) W_enc + b_enc, x without a gradient."""

    @staticmethod
    def forward(ctx, pre: Tensor, x: Tensor, b_dec: Tensor, W_enc: Tensor, b_enc: Tensor,
                rows: Tensor, latents: Tensor) -> Tensor:
        ctx.save_for_backward(x, b_dec, W_enc, rows, latents)
        return pre.view(-1).index_select(0, rows * pre.shape[1] + latents)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, b_dec, W_enc, rows, latents = ctx.saved_tensors
        d, width = W_enc.shape
        dtype = torch.promote_types(W_enc.dtype, torch.float32)  # bfloat16 weights: float32 sums
        g = grad.to(dtype)  # (M,)
        g_b_enc = g.new_zeros(width).index_add_(0, latents, g)  # (width,)
        g_W_enc = None
        if ctx.needs_input_grad[3]:
            # (width, B) with M nonzeros, times the centred rows (B, d): (width, d)
            sparse = torch.sparse_coo_tensor(torch.stack([latents, rows]), g, (width, x.shape[0]),
                                             check_invariants=False)  # unique (latent, row) pairs
            g_W_enc = torch.sparse.mm(sparse, (x - b_dec).to(dtype)).T.to(W_enc.dtype)  # (d, width)
        # d pre / d b_dec = -W_enc for every row: the rows' sum is -W_enc @ (grad summed per latent)
        g_b_dec = -(W_enc.to(dtype) @ g_b_enc) if ctx.needs_input_grad[2] else None  # (d,)
        return (None, None, None if g_b_dec is None else g_b_dec.to(b_dec.dtype), g_W_enc,
                g_b_enc.to(W_enc.dtype) if ctx.needs_input_grad[4] else None, None, None)


class _DecoderGradient(torch.autograd.Function):
    """Zeros `(N, d)` in the forward; in the backward, the gradient of `active_decode` in W_dec: the
    code's transpose times the incoming gradient, (width, N) sparse @ (N, d)."""

    @staticmethod
    def forward(ctx, W_dec: Tensor, values: Tensor, latents: Tensor, offsets: Tensor) -> Tensor:
        ctx.save_for_backward(values, latents, offsets)
        ctx.width = W_dec.shape[0]
        return W_dec.new_zeros(()).expand(len(offsets), W_dec.shape[1])

    @staticmethod
    def backward(ctx, grad: Tensor):
        values, latents, offsets = ctx.saved_tensors
        rows = entry_rows(offsets, len(latents))  # (M,)
        dtype = torch.promote_types(grad.dtype, torch.float32)  # bfloat16 weights: float32 sums
        code_t = torch.sparse_coo_tensor(torch.stack([latents, rows]), values.to(dtype), (ctx.width, len(offsets)),
                                         check_invariants=False)
        return torch.sparse.mm(code_t, grad.to(dtype)).to(grad.dtype), None, None, None


def active_decode(latents: Tensor, values: Tensor, offsets: Tensor, W_dec: Tensor) -> Tensor:
    """`F.embedding_bag(latents, W_dec, offsets, mode="sum", per_sample_weights=values)` `(N, d)`: the
    same value and gradients, but on CPU W_dec's gradient is a sparse-dense product (`_DecoderGradient`)
    instead of embedding_bag's dense backward, which sorts the M entries by latent first (half of the
    decode's forward and backward at width 9216, k 32; the same gradients up to summation order,
    deterministic whatever the thread count)."""
    if not (W_dec.requires_grad and torch.is_grad_enabled() and W_dec.device.type == "cpu"):
        return F.embedding_bag(latents, W_dec, offsets, mode="sum", per_sample_weights=values)
    x_hat = F.embedding_bag(latents, W_dec.detach(), offsets, mode="sum", per_sample_weights=values)
    return x_hat + _DecoderGradient.apply(W_dec, values.detach(), latents, offsets)


def entry_rows(offsets: Tensor, m: int) -> Tensor:
    """The row of each of `m` entries `(m,)` from where each row's entries start `(N,)` (embedding_bag's offsets)."""
    counts = torch.diff(offsets, append=offsets.new_tensor([m]))  # (N,)
    return torch.arange(len(offsets), device=offsets.device).repeat_interleave(counts)


def sparse_backward(x: Tensor) -> bool:
    """Whether the encoder's backward goes through `active_pre` for rows on x's device."""
    return x.device.type == "cpu"


def row_major(indices: Tensor) -> tuple[Tensor, Tensor]:
    """Column indices `(N, k)` per row -> (rows, latents) `(N k,)` each, grouped by row."""
    n, k = indices.shape
    return torch.arange(n, device=indices.device).repeat_interleave(k), indices.flatten()


def active_pre(pre: Tensor, rows: Tensor, latents: Tensor, x: Tensor, w: dict[str, Tensor]) -> Tensor:
    """`pre[rows, latents]` `(M,)`, differentiable in w's b_dec, W_enc and b_enc; `pre` `(B, width)`
    was computed from x `(B, d)` and w without a graph (else it is just the indexing)."""
    if pre.requires_grad:
        return pre[rows, latents]
    return _ActivePre.apply(pre, x, w["b_dec"], w["W_enc"], w["b_enc"], rows, latents)


def prefix_losses(x: Tensor, x_hat: Tensor, active: Active, W_dec: Tensor, b_dec: Tensor,
                  prefixes: Sequence[int], weights: Sequence[float]) -> Tensor:
    """sum_m weight_m * mean_rows ||x - (z[:, :m] @ W_dec[:m] + b_dec)||^2 over the prefix sizes m,
    from the code's active latents `(M,)` alone (values, latents and row offsets, as the TopK step
    gathers them): each prefix decodes its own active latents, O(M d), with no dense `(B, width)`
    code and no top-k over it. `x_hat` is the full-width reconstruction (the last prefix)."""
    loss = x.new_zeros(())
    width = prefixes[-1]
    rows = None
    for stop, weight in zip(prefixes, weights):
        if stop == width:
            recon = x_hat
        else:
            if rows is None:
                rows = entry_rows(active.offsets, len(active.latents))  # (M,)
            recon = _prefix_decode(active, rows, stop, W_dec) + b_dec
        loss = loss + weight * (x - recon).pow(2).sum(-1).mean()
    return loss


def _prefix_decode(active: Active, rows: Tensor, stop: int, W_dec: Tensor) -> Tensor:
    """`z[:, :stop] @ W_dec[:stop]` `(N, d)` from the active latents before `stop` alone (each row's in
    their order): the terms of the latents past it are zero, so leaving them out gives the same sums
    and gradients, and the gather and its backward touch only the prefix's share of the entries."""
    inside = torch.nonzero(active.latents < stop).flatten()  # (m,), in entry order
    counts = torch.zeros_like(active.offsets).index_add_(0, rows[inside], torch.ones_like(inside))  # (N,)
    offsets = torch.cumsum(counts, 0) - counts
    return active_decode(active.latents[inside], active.values[inside], offsets, W_dec)
