"""The collectives of a data-parallel SAE step across processes: what DDP does, on tensors.

    sae.comm = comm                 # a conceptlens.distributed.Comm, when each rank feeds its own rows
    sae.update(x)                   # every step: local forward/backward, one all-reduce, Adam

Each rank computes the gradient of its own rows' loss; one all-reduce sums the gradients
weighted by each rank's row count, the latents' firing counts and the step's statistics,
so every rank applies the same gradient (that of the mean loss over all ranks' rows: W
ranks with per-rank batch B step like one process with batch W*B, for losses that are
means over rows) and keeps identical parameters, Adam moments and dead-latent records.
Two losses are not means over rows, so there the ranks step like W processes of batch B whose
gradients are averaged, close to but not one process with batch W*B: BatchTopK keeps the top
k*B of each rank's rows (and its threshold is the mean of the ranks' smallest kept values), and
AuxK divides by the variance of each rank's residual. The step's statistics are exact (the
FVU's spread is about every rank's rows' common mean).
A rank without rows this step contributes zeros. The first step's parameters are broadcast
from the lowest rank that has rows; non-trainable buffers (BatchTopK's threshold) are
averaged over the ranks that had rows after every step. `SAETrainer` takes the step and
calls these.
`fit(distributed=True)` does not set it: it gathers the rows instead (DESIGN.md, "Distributed").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def all_reduce_step(comm: Any, params: list[Tensor], counts: Tensor, numbers: Tensor,
                    n: int) -> tuple[int, Tensor, list[float]]:
    """Sum this rank's row-weighted gradients, firing counts `(width,)` and step numbers (float64 sums
    such as the squared error) over the ranks; every parameter's `.grad` becomes the mean gradient.

    Returns (rows of all ranks, at least 1; the summed counts `(width,)` int64; the summed numbers)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.detach().flatten().double() * n for g in grads]
                     + [counts.double(), numbers, numbers.new_tensor([n])])
    flat = comm.sum_(flat)
    total = max(int(flat[-1].item()), 1)
    offset = 0
    for p in params:
        p.grad = (flat[offset:offset + p.numel()] / total).view_as(p).to(p.dtype)
        offset += p.numel()
    width = counts.numel()
    return total, flat[offset:offset + width].round().long(), flat[offset + width: -1].tolist()


def broadcast_first(comm: Any, tensors: list[Tensor], has_rows: bool) -> None:
    """Every rank takes the `tensors` of the lowest rank that has rows (in place)."""
    src = comm.world - comm.max_int(comm.world - comm.rank if has_rows else 0)
    with torch.no_grad():
        for t in tensors:
            t.copy_(comm.broadcast_(t, src))


def sync_buffers(comm: Any, buffers: list[Tensor], n: int) -> None:
    """Float buffers: the mean over the ranks that had rows; integer buffers: the largest (in place)."""
    if not buffers:
        return
    has = 1.0 if n else 0.0
    floats = [b for b in buffers if b.is_floating_point()]
    if floats:
        flat = comm.sum_(torch.cat([b.detach().flatten().double().cpu() * has for b in floats]
                                   + [torch.tensor([has], dtype=torch.float64)]))
        flat, count = flat[:-1] / max(flat[-1].item(), 1.0), flat[-1]
        offset = 0
        for b in floats:
            if count > 0:
                b.copy_(flat[offset:offset + b.numel()].view_as(b).to(b))
            offset += b.numel()
    for b in buffers:
        if not b.is_floating_point():
            b.copy_(comm.max_(b))
