"""A VQ codebook sharded across the ranks of a distributed fit: each rank holds 1/W of the codes.

    # torchrun --nproc-per-node 4 fit.py   (fit.py:)
    vq = ShardedVQ(65536, batch_size=4096)          # rank r keeps codes shard_range(65536, 4, r)
    lens.fit({"blocks.6.resid_out": vq}, texts, distributed=True)
    vq.concept_set()                                # every code, gathered (a collective: all ranks call it)

As `ShardedKMeans` (sharded.py), it needs the same rows on every rank (`fit(..., distributed=True)`
gives them) and splits the dictionary, not the rows. A step draws each row's code among its
`top_k` nearest over every shard: each rank sends its own shard's k nearest (distances, global
indices) and the exact squared error to its nearest code, one all-gather of `(N, 2k + 1)`
float64 per rank; every rank merges them into the same global k nearest and draws the same
uniforms as one process. A code's EMA count and sum read only the rows that drew it, so they
are updated on the rank that owns it; the Laplace smoothing needs the total EMA count of every
shard (one all-reduce of W numbers). The initialising k-means runs sharded too: k-means++ picks
rows (the same on every rank, as one process's), and each Lloyd iteration takes the global
nearest (`Shards.nearest`) and moves this rank's centres. Reseeding reads every shard's counts
(K numbers) and draws the same rows everywhere; each rank restarts its own dead codes. The
FVU statistics and the generator are the same on every rank. A checkpoint holds each rank's
shard; merging is refused (the ranks hold different codes of one fit). Outside a process group
(or on one rank) it is the unsharded codebook, up to the rounding of the distance kernel.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.concepts.kmeans_math import _unit, kmeans_plusplus
from conceptlens.concepts.sharded import SplitOverRanks
from conceptlens.concepts.vq import VQCodebook
from conceptlens.concepts.vq_config import CodebookState, VQStep
from conceptlens.concepts.vq_math import (codes_from_ema, ema_update, fvu_sums, laplace_smooth, sample_nearest,
                                          sampled_distances)


class ShardedVQ(SplitOverRanks, VQCodebook):
    """`VQCodebook` whose codes are split across the ranks (see the module docstring).

    `codes`, `counts`, `assign`, `encode`, `quantize`, `stats` and `concept_set` are global
    (collectives: every rank calls them); `fitted` holds this rank's shard."""

    _split = ("n_codes", "codes")

    @property
    def codes(self) -> Tensor:
        return self.shards.gather(self._fitted().codes, self.shards.sizes)

    @property
    def counts(self) -> Tensor:
        return self.shards.gather(self._fitted().counts, self.shards.sizes)

    def update(self, x: Tensor) -> None:
        if self.comm is not None:
            raise ValueError("a ShardedVQ takes the same rows on every rank (fit(..., distributed=True)), "
                             "not per-rank rows: leave its comm unset")
        super().update(x)

    # ---- training ----------------------------------------------------------------------

    def train_step(self, x: Tensor, shared: bool = False) -> VQStep:
        """One EMA step on the global batch `x` (N, d), the same on every rank. The returned
        `quantized` holds the codes this rank owns and zeros on the rows of other ranks' codes."""
        cfg, fit, lo, hi = self.config, self._fitted(), self.shards.lo, self.shards.hi
        x = self._prepare(x)
        neg, index, sse = self._top_k(x, fit.codes)
        code = sample_nearest(neg, index, cfg.temperature, self._gen)  # (N,) global
        mine = (code >= lo) & (code < hi)
        quantized = torch.zeros(x.shape, dtype=fit.codes.dtype, device=x.device)
        quantized[mine] = fit.codes[code[mine] - lo]
        ones = torch.ones(int(mine.sum()), dtype=fit.counts.dtype, device=x.device)
        counts = torch.zeros_like(fit.counts).index_add_(0, code[mine] - lo, ones)
        sums = torch.zeros_like(fit.sums).index_add_(0, code[mine] - lo, x[mine].to(fit.sums.dtype))
        nearest = index[:, 0]
        near = (nearest >= lo) & (nearest < hi)
        fit.hits.index_add_(0, nearest[near] - lo, torch.ones_like(nearest[near]).to(fit.hits.dtype))
        fvu = fvu_sums(x, x)  # N, sum |x|^2 and sum x; the squared errors come from the nearest codes' ranks
        fvu[1] = sse.sum()
        fit.counts, fit.sums = ema_update(fit.counts, fit.sums, counts, sums, cfg.decay)
        fit.codes = codes_from_ema(fit.counts, fit.sums, cfg.eps, self.shards.total(fit.counts), cfg.n_codes)
        fit.fvu = cfg.decay * fit.fvu + (1 - cfg.decay) * fvu
        self.steps += 1
        self.tokens += len(x)
        if cfg.reseed_after and self.steps % cfg.reseed_after == 0:
            self._reseed(fit, x)
        return VQStep(code, quantized)

    def _top_k(self, x: Tensor, codes: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Each row's `top_k` nearest codes over every shard: (negated distances (N, k), global
        indices (N, k), nearest first; squared error to the nearest code (N,) float64)."""
        k = min(self.config.top_k, self.config.n_codes)
        dist = sampled_distances(x, codes, self.config)  # (N, K/W), as `VQCodebook.train_step`
        neg, index = (-dist).topk(min(k, dist.shape[1]), dim=1)  # (N, k'), this shard's nearest first
        index = index + self.shards.lo
        sse = (x.double() - codes[index[:, 0] - self.shards.lo].double()).pow(2).sum(1)  # (N,)
        if self.shards.comm is None:
            return neg, index, sse
        pad = k - neg.shape[1]  # a shard smaller than k: its missing candidates are infinitely far
        mine = torch.cat([F.pad(neg.double(), (0, pad), value=float("-inf")),
                          F.pad(index.double(), (0, pad), value=-1.0), sse[:, None]], 1)  # (N, 2k + 1)
        n, world = len(x), self.shards.world
        every = self.shards.gather(mine.cpu(), [n] * world).view(world, n, 2 * k + 1).to(x.device)
        negs = every[..., :k].permute(1, 0, 2).reshape(n, world * k)  # (N, W k) in rank order
        indices = every[..., k:2 * k].permute(1, 0, 2).reshape(n, world * k)
        top, at = negs.topk(k, dim=1)  # (N, k) the global nearest first
        owner = at[:, 0] // k  # the rank of each row's nearest code
        sse = every[owner, torch.arange(n, device=x.device), 2 * k]
        return top.to(dist.dtype), indices.gather(1, at).long(), sse

    def _reseed(self, fit: CodebookState, x: Tensor, synced: bool = False) -> None:
        """As `VQCodebook._reseed`, over every shard's counts; each rank restarts its own dead codes."""
        cfg, lo, hi = self.config, self.shards.lo, self.shards.hi
        counts = self.shards.gather(fit.counts, self.shards.sizes)  # (K,) the same on every rank
        share = counts.sum() / cfg.n_codes
        dead = torch.nonzero(counts < cfg.reseed_threshold * share).squeeze(1)
        if dead.numel() == 0 or len(x) == 0:
            return
        if len(x) >= len(dead):
            pick = torch.randperm(len(x), generator=self._gen)[: len(dead)]
        else:
            pick = torch.randint(len(x), (len(dead),), generator=self._gen)
        counts[dead] = share
        smooth = laplace_smooth(counts, cfg.eps)[lo:hi]  # (K/W,) as one process smooths the whole codebook
        own = (dead >= lo) & (dead < hi)
        local = dead[own] - lo
        fit.counts[local] = share
        fit.sums[local] = x[pick[own.cpu()].to(x.device)] * smooth[local, None]
        fit.codes = fit.sums / smooth[:, None]

    def _initialise(self, x: Tensor) -> None:
        """This rank's slice of the codes one process initialises on x (M, d), and their EMA state."""
        cfg, lo, hi = self.config, self.shards.lo, self.shards.hi
        x = x.float()
        centres, labels = self._initial_codes(x)  # (K/W, d), (M,) global
        rows_per_step = cfg.batch_size or len(x) / max(self._init_calls, 1)
        counts = torch.bincount(labels, minlength=cfg.n_codes).to(x) * (rows_per_step / len(x))  # (K,)
        smooth = laplace_smooth(counts, cfg.eps)[lo:hi]
        sums = centres * smooth[:, None]
        self.fitted = CodebookState(sums / smooth[:, None], counts[lo:hi].clone(), sums,
                                    torch.zeros(hi - lo, dtype=torch.long, device=x.device),
                                    torch.zeros(x.shape[1] + 3, dtype=torch.float64, device=x.device))
        self._pending = None

    def _initial_codes(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """`initial_codes` sharded: (this rank's centres (K/W, d), every row's global label (M,))."""
        cfg, lo, hi = self.config, self.shards.lo, self.shards.hi
        if cfg.init == "random":
            centres = x[torch.randperm(len(x), generator=self._gen)[: cfg.n_codes][lo:hi].to(x.device)]
            return centres, self.shards.nearest(x, centres)[0]
        spherical = cfg.init == "spherical_kmeans"
        data = F.normalize(x, dim=1) if spherical else x
        centres = self._lloyd(data, spherical)
        centres = F.normalize(centres, dim=1) if spherical else centres
        labels = self.shards.nearest(data, centres)[0]
        if spherical:
            mine = (labels >= lo) & (labels < hi)
            counts = torch.bincount(labels[mine] - lo, minlength=hi - lo).to(x)
            norms = torch.zeros_like(counts).index_add_(0, labels[mine] - lo, x[mine].norm(dim=1)) / counts.clamp(min=1)
            centres = centres * torch.where(counts > 0, norms, x.norm(dim=1).mean())[:, None]
        return centres, labels

    def _lloyd(self, points: Tensor, spherical: bool, max_iter: int = 100) -> Tensor:
        """`weighted_lloyd` with unit weights, sharded: this rank's centres (K/W, d) of points (M, d)."""
        lo, hi = self.shards.lo, self.shards.hi
        view = _unit(points) if spherical else points
        ones = torch.ones(len(points), device=points.device)
        centres = points[kmeans_plusplus(view, self.config.n_codes, self._gen, ones)[lo:hi]]  # rows, as one process
        labels = None
        for _ in range(max_iter):
            new = self.shards.nearest(view, _unit(centres) if spherical else centres)[0]
            if labels is not None and torch.equal(new, labels):
                break
            labels = new
            mine = (labels >= lo) & (labels < hi)
            mass = torch.zeros(hi - lo, dtype=torch.float64, device=points.device).index_add_(
                0, labels[mine] - lo, ones[mine].double())
            sums = torch.zeros_like(centres).index_add_(0, labels[mine] - lo, points[mine])
            centres = torch.where(mass[:, None] > 0, sums / mass.clamp_min(1e-300)[:, None].to(points.dtype), centres)
        return centres

    def mark_shared_start(self) -> None:
        self._origin = None  # no merges: no shared start to remember (it would double the memory)

    def _merge(self, other: Any) -> None:
        raise ValueError("a ShardedVQ is not merged: its ranks hold different codes of one fit")

    # ---- evaluation --------------------------------------------------------------------

    def assign(self, x: Tensor) -> Tensor:
        """Nearest code over every shard per token: (N, d) -> (N,) long."""
        return self.shards.nearest(self._prepare(x, torch.float32), self._fitted().codes)[0]

    def quantize(self, x: Tensor) -> Tensor:
        return self.codes[self.assign(x)]

    def concept_set(self) -> ConceptSet:
        """Every code (gathered from every rank: call it on all of them)."""
        fit, sizes = self._fitted(), self.shards.sizes
        codes, counts = self.shards.gather(fit.codes, sizes), self.shards.gather(fit.counts, sizes)
        config = {**self.config_dict(), "fit_stats": self.stats()._asdict()}
        return ConceptSet(codes, method=self.method, config=config, encoder={"codebook": codes.clone()},
                          stats={"ema_count": counts, "hits": self.shards.gather(fit.hits, sizes)},
                          mean=self.shards.gather(fit.sums, sizes).sum(0) / counts.sum())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's shard (a fit's checkpoint gives each rank its own state)."""
        fitted = state.get("fitted")
        rows = None if fitted is None else fitted["codes"].shape[0]
        if rows is not None and rows != self.shards.hi - self.shards.lo:
            raise ValueError(f"state holds {rows} codes; rank {self.shards.rank} of {self.shards.world} holds "
                             f"{self.shards.hi - self.shards.lo}: load each rank's state on the same world size")
        super().load_state_dict(state)
