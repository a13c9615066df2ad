"""Data-parallel SAE steps across processes: what DDP does, on the SAE's parameter dict.

    sae.comm = comm                 # a conceptlens.distributed.Comm; the fit sets it
    sae.update(x)                   # every step: local forward/backward, one all-reduce, Adam

Each rank computes the gradient of its own rows' loss; one all-reduce sums the gradients
weighted by each rank's row count, the latents' firing counts and the step's statistics,
so every rank applies the same gradient (that of the mean loss over all ranks' rows: W
ranks with per-rank batch B step like one process with batch W*B, for losses that are
means over rows) and keeps identical parameters, Adam moments and dead-latent records.
A rank without rows this step contributes zeros. The first step's parameters are broadcast
from the lowest rank that has rows; non-trainable buffers (BatchTopK's threshold) are
averaged over the ranks that had rows after every step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor


if TYPE_CHECKING:
    from conceptlens.concepts.sae.base import SparseAutoencoder


def step(sae: SparseAutoencoder, x: Tensor) -> None:
    """One synchronised optimiser step on this rank's normalised rows `x` `(n, d)` (n may be 0)."""
    comm, n = sae.comm, x.shape[0]
    if sae._opt is None:
        _start(sae, x)
    w = sae._compute_weights()
    sae._optimiser().zero_grad(set_to_none=True)
    code = None
    counts = x.new_zeros(sae.config.width)
    numbers = x.new_zeros(3, dtype=torch.float64)
    if n:
        code = sae._encode(x.to(sae.compute_dtype), w, train=True)
        x_hat = sae._decode(code.z, w, train=True)
        loss = sae._recon_loss(x, code.z, x_hat, w) + sae._penalty(x, x_hat, code, w)
        loss.backward()
        counts = x.new_ones(n) @ code.z.detach().ne(0).float()  # (width,)
        sse = (x - x_hat.detach()).pow(2).sum()
        var = (x - x.mean(0)).pow(2).sum()
        numbers = torch.stack([sse, var, loss.detach() * n]).double()
    params = list(sae.params.values())
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.detach().flatten().double() * n for g in grads]
                     + [counts.double(), numbers, numbers.new_tensor([n])])
    flat = comm.sum_(flat)
    total = max(int(flat[-1].item()), 1)
    offset = 0
    for p in params:
        p.grad = (flat[offset:offset + p.numel()] / total).view_as(p).to(p.dtype)
        offset += p.numel()
    counts = flat[offset:offset + sae.config.width].round().long()
    sse, var, loss_sum = flat[offset + sae.config.width: -1].tolist()
    with torch.no_grad():
        sae._apply_gradients()
        sae._tracker.observe(counts, total)
        values = torch.tensor([sse / max(var, 1e-12), float(counts.sum()) / total,  # the 4 StepStats fields
                               sae._tracker.dead().float().mean().item(), loss_sum / total], dtype=torch.float64)
        sae._running.observe(values, total)
        if code is not None:
            sae._after_step(code)
        _sync_buffers(sae, n)


def _start(sae: SparseAutoencoder, x: Tensor) -> None:
    """Create parameters and Adam on every rank, then take the first rank-with-rows' values."""
    comm = sae.comm
    sae._start(x if x.shape[0] else x.new_zeros(1, x.shape[1]))
    src = comm.world - comm.max_int(comm.world - comm.rank if x.shape[0] else 0)
    with torch.no_grad():
        for t in [*sae.params.values(), *sae.buffer_dict.values()]:
            t.copy_(comm.broadcast_(t, src))


def _sync_buffers(sae: SparseAutoencoder, n: int) -> None:
    """Float buffers: the mean over the ranks that had rows; integer buffers: the largest."""
    if not sae.buffer_dict:
        return
    comm, has = sae.comm, 1.0 if n else 0.0
    floats = [b for b in sae.buffer_dict.values() if b.is_floating_point()]
    if floats:
        flat = comm.sum_(torch.cat([b.detach().flatten().double().cpu() * has for b in floats]
                                   + [torch.tensor([has], dtype=torch.float64)]))
        flat, count = flat[:-1] / max(flat[-1].item(), 1.0), flat[-1]
        offset = 0
        for b in floats:
            if count > 0:
                b.copy_(flat[offset:offset + b.numel()].view_as(b).to(b))
            offset += b.numel()
    for b in sae.buffer_dict.values():
        if not b.is_floating_point():
            b.copy_(comm.max_(b))
