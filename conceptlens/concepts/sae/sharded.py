"""A TopK SAE whose latents are split across the ranks of a distributed fit (as sparsify shards them).

    sae = ShardedTopKSAE(width=1 << 20, k=64, seed=0)   # rank r holds latents shard_range(width, W, r)
    lens.fit({"blocks.6.resid_out": sae}, texts, distributed=True)

Every rank has the same rows (the fit gathers them) and its shard of W_enc's columns, b_enc
and W_dec's rows (with their Adam moments); b_dec is whole on every rank. One step:
- encode: each rank's pre-activations `(N, width/W)` and their top k; the W*k candidates of a
  row are all-gathered and the global top k kept (the same k latents as one process's topk);
- decode: each rank's winners times its decoder rows, summed over ranks by an all-reduce
  whose backward passes the (rank-independent) gradient through; b_dec is added by rank 0
  only, so that its gradient, summed over the ranks, counts the decoder term once and the
  encoder term of every shard: one all-reduce of b_dec's gradient per step;
- AuxK: the same global top k_aux over the dead latents of every shard;
- the firing counts of every shard are all-gathered, so the dead-latent records (width
  int64s) and the statistics are whole and the same on every rank.
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

    def _init_rows(self, width: int, d: int) -> Tensor:
        """This shard's rows of one process's initial decoder (drawn from the same generator stream)."""
        return randn_rows(width, d, self.shards.lo, self.shards.hi, self._gen)  # (width/W, d)

    def _global_topk(self, pre: Tensor, k: int) -> Tensor:
        """`(N, width/W)` mask of this shard's latents among each row's global top k of `pre`."""
        values, index = pre.detach().topk(min(k, pre.shape[1]), dim=1, sorted=False)  # (N, k')
        index = index + self.shards.lo
        if self.shards.comm is not None:  # candidates of every rank: (W*k', N) -> (N, W*k')
            values = self.shards.gather(values.T.contiguous().float()).T
            index = self.shards.gather(index.T.contiguous()).T
        top = values.topk(min(k, values.shape[1]), dim=1, sorted=False).indices  # (N, k)
        chosen = index.gather(1, top) - self.shards.lo  # (N, k) local indices, out of range: another rank's
        values = values.gather(1, top)
        ok = (chosen >= 0) & (chosen < pre.shape[1]) & (values > float("-inf"))
        rows = torch.arange(pre.shape[0], device=ok.device)[:, None].expand_as(ok)
        mask = torch.zeros(pre.shape, dtype=torch.bool, device=pre.device)
        mask[rows[ok].to(pre.device), chosen[ok].to(pre.device)] = True
        return mask

    def _encode(self, x: Tensor, w: dict[str, Tensor], train: bool) -> Code:
        if not train:  # inference: the gathered whole weights (`_raw`)
            return super()._encode(x, w, train)
        pre = (x - w["b_dec"]) @ w["W_enc"] + w["b_enc"]  # (N, width/W)
        return Code(torch.where(self._global_topk(pre, self.config.k), pre.relu(), 0.0), pre)

    def _decode(self, z: Tensor, w: dict[str, Tensor], train: bool = False) -> Tensor:
        if not train:
            return super()._decode(z, w, train)
        partial = z @ w["W_dec"]  # (N, d) this shard's part
        if self.shards.rank == 0:
            partial = partial + w["b_dec"]
        return _SumRanks.apply(partial, self.shards)

    def _penalty(self, x: Tensor, x_hat: Tensor, code: Code, w: dict[str, Tensor]) -> Tensor:
        """AuxK over the dead latents of every shard (the global top k_aux of their pre-activations)."""
        tracker = self._tracker
        if self.config.aux_coef == 0 or tracker.none_dead():
            return x.new_zeros(())
        if self._running.steps % 256 == 0:
            tracker.refresh()
        dead = tracker.dead()  # (width,) whole on every rank
        k_aux = min(self.config.k_aux or max(x.shape[1] // 2, 1), self.config.width)
        e = (x - x_hat).detach()
        pre = code.pre.masked_fill(~dead[self.shards.lo:self.shards.hi], float("-inf"))
        chosen = self._global_topk(pre, k_aux)
        e_hat = _SumRanks.apply(torch.where(chosen, pre, 0.0).relu() @ w["W_dec"], self.shards)
        var_e = (e - e.mean(0)).pow(2).sum().clamp(min=1e-12)
        var_x = (x - x.mean(0)).pow(2).sum()
        term = self.config.aux_coef * (e - e_hat).pow(2).sum() / var_e * var_x / x.shape[0]
        return torch.where(dead.any(), term, term.new_zeros(()))

    def _apply_gradients(self) -> None:
        b_dec = self.params["b_dec"]
        if self.shards.comm is not None and b_dec.grad is not None:
            b_dec.grad = self.shards.comm.sum_(b_dec.grad)
        super()._apply_gradients()

    def _record(self, x: Tensor, x_hat: Tensor, code: Code, loss: Tensor) -> None:
        whole = code.z.detach().ne(0).float()
        z = self.shards.gather(whole.T.contiguous()).T if self.shards.comm is not None else whole  # (N, width)
        super()._record(x, x_hat, Code(z, z), loss)

    def _raw(self) -> dict[str, Tensor]:
        """The whole raw-space weights, gathered from every shard."""
        raw = super()._raw()
        if self.shards.comm is None:
            return raw
        return {k: self.shards.gather(v.transpose(0, _SHARDED[k]).contiguous()).transpose(0, _SHARDED[k])
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
