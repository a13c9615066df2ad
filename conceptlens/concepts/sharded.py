"""Dictionaries sharded across the ranks of a distributed fit: each rank holds 1/W of the centres.

    # torchrun --nproc-per-node 4 fit.py   (fit.py:)
    km = ShardedKMeans(65536, seed=0)              # rank r keeps centres shard_range(65536, 4, r)
    lens.fit({"blocks.6.resid_out": km}, texts, distributed=True)
    km.concept_set()                               # every centre, gathered (a collective: all ranks call it)

`fit(..., distributed=True)` gives every rank the same global rows; a sharded extractor then
splits the dictionary, not the rows. Every global operation is exact: the nearest centre of a
row is the smallest of the W shards' nearest (their distances and indices all-gathered; on a
tie the lowest rank, i.e. the lowest centre index, as one process's argmin), and a centre's
update reads only the rows assigned to it, so it happens on the rank that owns it with no
further collective. The seeding draws row indices from the rows every rank has (k-means++
or batched D^2 sampling never needs the centres themselves), so each rank keeps its slice of
one process's seeds. Reseeding reads the idle counts of every shard (k int64s) and draws the
same rows on every rank (one generator, same state everywhere). A checkpoint holds each
rank's shard (rank 0 writes every rank's state in one file, as for any distributed fit; a
resume on another world size is refused).
Outside a process group (or with one rank) a sharded extractor is the unsharded one.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.concepts.kmeans import StreamingKMeans
from conceptlens.concepts.kmeans_config import KMeansStats
from conceptlens.concepts.kmeans_math import _unit, apply_step, mass_weighted_mean, nearest, step_statistics


def shard_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """The slice `[lo, hi)` of n items that rank `rank` of `world` holds (contiguous; the first
    n % world ranks hold one more), as `torch.tensor_split` cuts them."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def randn_rows(n: int, d: int, lo: int, hi: int, generator: torch.Generator) -> Tensor:
    """Rows `[lo, hi)` of `torch.randn(n, d, generator=generator)`, bit for bit, holding at most
    about `2 (hi - lo) d` numbers: the n rows are drawn in blocks and the others dropped, and the
    generator ends where the whole draw leaves it. Exact because torch's CPU normal fill draws one
    uniform per number in order and transforms them 16 at a time: blocks of a multiple of 16 rows
    start on a 16-number boundary, and the last block (at least 16 numbers) ends where the whole
    tensor does, so its tail is redrawn the same way (tests/test_sharded.py checks it)."""
    block = 16 * max(1, -(-(hi - lo) // 16))  # rows per block, a multiple of 16
    out = torch.empty(hi - lo, d)
    start = 0
    while start < n:
        stop = min(n, start + block)
        if (n - stop) * d < 16:  # a last block under 16 numbers would take torch's scalar path
            stop = n
        rows = torch.randn(stop - start, d, generator=generator)  # (stop - start, d)
        a, b = max(lo, start), min(hi, stop)
        if a < b:
            out[a - lo:b - lo] = rows[a - start:b - start]
        start = stop
    return out


class Shards:
    """The process group a sharded extractor splits over (the default group; world 1 without one)."""

    def __init__(self, n: int, what: str) -> None:
        from conceptlens.distributed import Comm

        self.comm = Comm() if dist.is_available() and dist.is_initialized() else None
        self.world = 1 if self.comm is None else self.comm.world
        self.rank = 0 if self.comm is None else self.comm.rank
        if n < self.world:
            raise ValueError(f"cannot shard {n} {what} over {self.world} processes: use at least {self.world}")
        self.lo, self.hi = shard_range(n, self.world, self.rank)
        self.sizes = [b - a for a, b in (shard_range(n, self.world, r) for r in range(self.world))]
        """Every rank's number of items, in rank order."""

    def gather(self, t: Tensor, sizes: list[int] | None = None) -> Tensor:
        """Every rank's `t` concatenated along dim 0 in rank order (the whole dictionary);
        `sizes`: every rank's `len(t)` when known (`self.sizes` for a shard; saves a collective)."""
        return t if self.comm is None else self.comm.gather_rows(t, sizes)

    def total(self, t: Tensor) -> Tensor:
        """The sum of `t` over every shard, the same on every rank (the ranks' sums added in rank order)."""
        if self.comm is None:
            return t.sum()
        part = torch.zeros(self.world, dtype=torch.float64)
        part[self.rank] = t.sum().double()
        return self.comm.sum_(part).sum().to(t.device, t.dtype)

    def nearest(self, x: Tensor, shard: Tensor) -> tuple[Tensor, Tensor]:
        """(global labels (N,), squared distance (N,)) of rows x `(N, d)` to the nearest centre over every shard."""
        labels, best = nearest(x, shard)
        labels = labels + self.lo
        if self.comm is None:
            return labels, best
        both = self.gather(torch.stack([best.double(), labels.double()]).cpu(), [2] * self.world)
        both = both.view(self.world, 2, -1)  # (W, 2, N)
        owner = both[:, 0].argmin(0)  # (N,) the first of equal minima: the lowest centre index
        pick = both[owner, :, torch.arange(owner.numel())]  # (N, 2) the winning rank's (distance, label)
        return pick[:, 1].long().to(x.device), pick[:, 0].to(best.dtype).to(x.device)


class SplitOverRanks:
    """Mixin of a sharded extractor: `shards`, the ranks' split of its `config.<_split[0]>` items
    (`_split[1]` names them), read from the process group at first use (the fit starts the group
    after the extractors are made)."""

    _split: ClassVar[tuple[str, str]]
    _shards: Shards | None = None
    config: Any

    @property
    def shards(self) -> Shards:
        if self._shards is None:
            field, what = self._split
            self._shards = Shards(getattr(self.config, field), what)
        return self._shards


class ShardedKMeans(SplitOverRanks, StreamingKMeans):
    """`StreamingKMeans` whose centres are split across the ranks (see the module docstring).

    Needs the same rows on every rank (`fit(..., distributed=True)` gives them), not per-rank
    rows (`comm` set); `centres`, `mass`, `encode` and `concept_set` gather every shard."""

    _split = ("n_concepts", "centres")

    @property
    def centres(self) -> Tensor:
        c = self.shards.gather(self._state()[0], self.shards.sizes)
        return _unit(c) if self.config.spherical else c

    @property
    def mass(self) -> Tensor:
        return self.shards.gather(self._state()[1], self.shards.sizes)

    def stats(self) -> KMeansStats:
        """One process's statistics: the live fraction over every shard's centres (a collective, as
        `mass`: every rank calls it; a fit's report does)."""
        own = super().stats()
        return own if self._centres is None else own._replace(live_fraction=(self.mass > 0).float().mean().item())

    def _update(self, x: Tensor, weight: Tensor) -> None:
        if self.comm is not None:
            raise ValueError("a ShardedKMeans takes the same rows on every rank (fit(..., distributed=True)), "
                             "not per-rank rows: leave its comm unset")
        super()._update(x, weight)

    def flush(self) -> None:
        """Initialise on the buffered rows: this rank's slice of one process's seeds."""
        if self._centres is not None or self._pending is None:
            return
        x, w = self._pending
        self._pending = None
        chosen = self._seed_rows(x, w)  # (k,) the same on every rank
        lo, hi = self.shards.lo, self.shards.hi
        self._centres = x[chosen[lo:hi]].float().clone()
        self._mass, self._idle = self._mass[lo:hi].to(x.device), self._idle[lo:hi].to(x.device)
        self._steps(x, w, shared=True)

    def _state(self) -> tuple[Tensor, Tensor]:
        """This rank's centres and masses (fitted)."""
        return self._fitted()

    def _step(self, x: Tensor, w: Tensor, synced: bool = False) -> None:
        centres, _ = self._state()
        view = _unit(centres) if self.config.spherical else centres
        labels, best = self.shards.nearest(x, view)  # global
        mine = (labels >= self.shards.lo) & (labels < self.shards.hi)
        sums, received = step_statistics(centres, self._mass, x[mine], w[mine], labels[mine] - self.shards.lo)
        self._centres, self._mass, received = apply_step(centres, self._mass, sums, received)
        self._idle = torch.where(received > 0, 0, self._idle + x.shape[0])
        self.n_steps += 1
        if self.config.reseed_after is not None:
            self._reseed(x, w, best)

    def _reseed(self, x: Tensor, w: Tensor, best: Tensor, synced: bool = False, rows: int | None = None) -> None:
        """As `StreamingKMeans._reseed`, over every shard's idle counts; each rank moves its own dead centres."""
        limit = self.config.reseed_after * self.config.n_concepts
        self._idle_bound += x.shape[0]
        if self._idle_bound < limit:
            return
        idle = self.shards.gather(self._idle, self.shards.sizes)  # (k,) the same on every rank
        self._idle_bound = int(idle.max())
        if self._idle_bound < limit:
            return
        dead = torch.nonzero(idle >= limit).flatten()
        score = (w * best).double().cpu()
        n = min(dead.numel(), int((score > 0).sum()))
        if n == 0:
            return
        picked = torch.multinomial(score, n, replacement=False, generator=self._gen).to(x.device)
        dead = dead[:n]
        own = (dead >= self.shards.lo) & (dead < self.shards.hi)
        local = dead[own] - self.shards.lo
        centres, _ = self._state()
        centres[local] = x[picked[own.to(picked.device)]].to(centres.dtype)
        self._mass[local] = 0.0
        self._idle[local] = 0
        self.n_reseeded += n
        idle[dead] = 0
        self._idle_bound = int(idle.max())

    def _merge(self, other: Any) -> None:
        raise ValueError("a ShardedKMeans is not merged: its ranks hold different centres of one fit")

    def concept_set(self) -> ConceptSet:
        """Every centre (gathered from every rank: call it on all of them)."""
        centres, mass = self.centres, self.mass
        return ConceptSet(centres, method=self.method, config=self.config_dict(), stats={"mass": mass.float()},
                          mean=mass_weighted_mean(centres, mass))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's shard (a fit's checkpoint gives each rank its own state)."""
        rows = None if state.get("centres") is None else state["centres"].shape[0]
        if rows is not None and rows != self.shards.hi - self.shards.lo:
            raise ValueError(f"state holds {rows} centres; rank {self.shards.rank} of {self.shards.world} holds "
                             f"{self.shards.hi - self.shards.lo}: load each rank's state on the same world size")
        super().load_state_dict(state)
        if self._centres is None or self._idle is None or not self._idle.numel():
            return  # before k-means++ every rank holds all k idle counts (flush slices them): the bound is its own
        self._idle_bound = int(self.shards.gather(self._idle, self.shards.sizes).max())  # one bound on every rank
