"""A TopK SAE whose latents are split across the ranks of a distributed fit (as sparsify shards them).

    sae = ShardedTopKSAE(width=1 << 20, k=64, seed=0)   # rank r holds latents shard_range(width, W, r)
    lens.fit({"blocks.6.resid_out": sae}, texts, distributed=True)

Every rank has the same rows (the fit gathers them) and its shard of W_enc's columns, b_enc
and W_dec's rows (with their Adam moments); b_dec is whole on every rank. One step, three
collectives whether or not AuxK runs:
- encode: each rank's pre-activations `(N, width/W)`, their top k and (AuxK) the top k_aux of
  its dead latents' ones; these candidates (values and global indices, packed in one float64
  tensor) are all-gathered once and each row's global top k (k_aux) kept: the latents one
  process's topk picks;
- decode: each rank's winners times its decoder rows (and AuxK's), packed with the shard's
  firing counts (zero outside its slice) and summed over ranks by one all-reduce whose
  backward passes the (rank-independent) gradient through; the counts make the dead-latent
  records (width int64s) and the statistics whole and the same on every rank;
- b_dec is added by rank 0 only, so that its gradient, summed over the ranks, counts the
  decoder term once and the encoder term of every shard: one all-reduce of b_dec's gradient.
Adam and the decoder-row constraint act per latent, so the shard's updates equal one
process's. Each rank draws only its rows of one process's initial decoder (`randn_rows`: the
same generator stream, the other rows dropped block by block), so a rank never holds more than
about 2/W of the decoder, at the first step as after it. `concept_set()` and `encode()` gather
every shard (collectives: every rank calls them).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from conceptlens.concepts.sae.active import Active
from conceptlens.concepts.sae.base import Code
from conceptlens.concepts.sae.persist import module_layout
from conceptlens.concepts.sae.topk import TopKSAE
from conceptlens.concepts.sharded import Shards, SplitOverRanks, randn_rows

_SHARDED = MappingProxyType({"W_enc": 1, "b_enc": 0, "W_dec": 0})  # parameter -> the dimension split across ranks


class _SumRanks(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward (the loss is the same on every rank)."""

    @staticmethod
    def forward(ctx: Any, partial: Tensor, shards: Shards) -> Tensor:
        return partial if shards.comm is None else shards.comm.sum_(partial)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class ShardedTopKSAE(SplitOverRanks, TopKSAE):
    """`TopKSAE` with its latents sharded across ranks (see the module docstring)."""

    _split = ("width", "latents")
    _fired: Tensor | None = None  # (width,) the step's firing counts of every shard (`_forward` -> `_counted`)
    _aux: tuple[Tensor, Tensor] | None = None  # AuxK's (e_hat (N, d), dead (width,)) (`_forward` -> `_penalty`)

    def _init_rows(self, width: int, d: int) -> Tensor:
        """This shard's rows of one process's initial decoder (drawn from the same generator stream)."""
        return randn_rows(width, d, self.shards.lo, self.shards.hi, self.trainer.generator)  # (width/W, d)

    def _forward(self, x: Tensor, w: dict[str, Tensor]) -> tuple[Tensor, Code, Tensor]:
        """The step's code and reconstruction with two collectives: one all-gather of every
        shard's top-k (and AuxK) candidates, one all-reduce of the partial reconstructions (and
        AuxK's) together with the firing counts."""
        pre = (x.to(self.compute_dtype) - w["b_dec"]) @ w["W_enc"] + w["b_enc"]  # (N, width/W)
        dead = self._aux_dead()  # (width,) or None: no AuxK this step
        k_aux = min(self.config.k_aux or max(x.shape[1] // 2, 1), self.config.width)
        local = None if dead is None else pre.masked_fill(~dead[self.shards.lo:self.shards.hi], float("-inf"))
        masks = self._global_topk([pre], [self.config.k]) if local is None else \
            self._global_topk([pre, local], [self.config.k, k_aux])
        z = torch.where(masks[0], pre.relu(), 0.0)  # (N, width/W)
        parts = [z @ w["W_dec"] + (w["b_dec"] if self.shards.rank == 0 else 0)]  # (N, d) this shard's part
        if local is not None:
            parts.append(torch.where(masks[1], local, 0.0).relu() @ w["W_dec"])  # (N, d) AuxK's part
        fired = pre.new_zeros(self.config.width, dtype=torch.float32)
        fired[self.shards.lo:self.shards.hi] = z.detach().ne(0).sum(0)  # (width,) this shard's counts, 0 elsewhere
        summed = _SumRanks.apply(torch.cat([p.float().flatten() for p in parts] + [fired]), self.shards)
        x_hat, *e_hat = summed[:-fired.numel()].to(pre.dtype).view(len(parts), *parts[0].shape).unbind(0)
        self._fired = summed[-fired.numel():].detach().long()  # (width,) every shard's counts
        self._aux = None if dead is None else (e_hat[0], dead)
        return x, Code(z, pre), x_hat

    def _aux_dead(self) -> Tensor | None:
        """The dead latents AuxK reads this step (whole, the same on every rank), or None (no AuxK)."""
        tracker = self.trainer.tracker
        if self.config.aux_coef == 0 or tracker.none_dead():
            return None
        if self.trainer.running.steps % 256 == 0:
            tracker.refresh()
        return tracker.dead()

    def _global_topk(self, pres: list[Tensor], ks: list[int]) -> list[Tensor]:
        """For each `pre` `(N, width/W)` and its k: the mask of this shard's latents among each
        row's global top k (the same latents as one process's top k), from one all-gather of
        every shard's candidates (values and global indices, exact in float64)."""
        lo, n_rows = self.shards.lo, pres[0].shape[0]
        parts = []
        for pre, k in zip(pres, ks):
            values, index = pre.detach().topk(min(k, pre.shape[1]), dim=1, sorted=False)  # (N, k')
            parts += [values.double().T, (index + lo).double().T]
        counts = [[min(k, size) for k in ks] for size in self.shards.sizes]  # every rank's k' per `pre`
        every = self.shards.gather(torch.cat(parts), [2 * sum(c) for c in counts])  # (sum over ranks of 2 k', N)
        chunks = every.split([n for c in counts for k_ in c for n in (k_, k_)])  # rank by rank: values, indices
        masks = []
        for i, (pre, k) in enumerate(zip(pres, ks)):
            mine = [chunks[2 * (r * len(ks) + i):2 * (r * len(ks) + i) + 2] for r in range(self.shards.world)]
            values = torch.cat([v for v, _ in mine]).T.to(pre.dtype)  # (N, sum of k'), in rank order
            index = torch.cat([j for _, j in mine]).T.long()
            top = values.topk(min(k, values.shape[1]), dim=1, sorted=False).indices  # (N, k)
            chosen = index.gather(1, top) - lo  # (N, k) local indices, out of range: another rank's
            ok = (chosen >= 0) & (chosen < pre.shape[1]) & (values.gather(1, top) > float("-inf"))
            rows = torch.arange(n_rows, device=ok.device)[:, None].expand_as(ok)
            mask = torch.zeros(pre.shape, dtype=torch.bool, device=pre.device)
            mask[rows[ok].to(pre.device), chosen[ok].to(pre.device)] = True
            masks.append(mask)
        return masks

    def _penalty(self, x: Tensor, x_hat: Tensor, code: Code, w: dict[str, Tensor]) -> Tensor:
        """AuxK over the dead latents of every shard (their global top k_aux, reconstructed in `_forward`)."""
        if self._aux is None:
            return x.new_zeros(())
        e_hat, dead = self._aux
        self._aux = None
        e = (x - x_hat).detach()
        var_e = (e - e.mean(0)).pow(2).sum().clamp(min=1e-12)
        var_x = (x - x.mean(0)).pow(2).sum()
        term = self.config.aux_coef * (e - e_hat).pow(2).sum() / var_e * var_x / x.shape[0]
        return torch.where(dead.any(), term, term.new_zeros(()))

    def _reduce_gradients(self) -> None:
        b_dec = self.params["b_dec"]
        if self.shards.comm is not None and b_dec.grad is not None:
            b_dec.grad = self.shards.comm.sum_(b_dec.grad)

    def _counted(self, code: Code) -> Code:
        # every shard's firing counts (summed in `_forward`) as the nonzeros of a sparse code,
        # which the trainer counts per latent: `counts[i]` ones at latent i
        fired = self._fired
        if fired is None:
            raise RuntimeError("ShardedTopKSAE._counted runs after _forward, which sums the firing counts")
        latents = torch.repeat_interleave(torch.arange(self.config.width, device=fired.device), fired)
        ones = torch.ones(latents.shape, device=latents.device)
        return Code(code.z, code.pre, Active(ones, latents, latents[:0]))

    def _raw(self) -> dict[str, Tensor]:
        """The whole raw-space weights, gathered from every shard."""
        raw = super()._raw()
        if self.shards.comm is None:
            return raw
        sizes = self.shards.sizes  # every shard's latents: no collective for the sizes
        return {k: self.shards.gather(v.transpose(0, _SHARDED[k]).contiguous(), sizes).transpose(0, _SHARDED[k])
                if k in _SHARDED else v for k, v in raw.items()}

    def _merge(self, other: Any) -> None:
        raise ValueError("a ShardedTopKSAE is not merged: its ranks hold different latents of one fit")

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """This rank's shard (a fit's checkpoint gives each rank its own state)."""
        W_dec = module_layout(state_dict).get("W_dec")
        if W_dec is not None and W_dec.shape[0] != self.shards.hi - self.shards.lo:
            raise ValueError(f"state holds {W_dec.shape[0]} latents; rank {self.shards.rank} of {self.shards.world} "
                             f"holds {self.shards.hi - self.shards.lo}: load each rank's state on the same world size")
        return super().load_state_dict(state_dict)
