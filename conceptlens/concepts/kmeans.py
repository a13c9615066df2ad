"""StreamingKMeans: weighted mini-batch k-means (Sculley 2010) over a stream of activations.

    km = StreamingKMeans(n_concepts=512, seed=0)
    for x in stream:                      # x: (N, d) float32
        km.update(x)                      # or km.update(x, weight=w) with w: (N,) >= 0
    cs = km.concept_set()                 # centres as directions, stats["mass"]

Each centre is the weighted running mean of every row ever assigned to it: per minibatch,
rows go to their nearest centre and c <- c + (sum_i w_i x_i - W c) / (m + W), with m the
centre's mass so far and W the batch's weight for it (Sculley's per-centre 1/mass learning
rate, applied to a whole batch at once).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from conceptlens._checks import known_kwargs
from conceptlens.concepts.base import ExtractorBase, NotFittedError
# the config, the stats, the state and the pure math live in kmeans_config.py and kmeans_math.py; re-exported here
from conceptlens.concepts.kmeans_config import KMeansConfig, KMeansState, KMeansStats, without_token_unit
from conceptlens.concepts.kmeans_math import (_unit, apply_step, batched_seeds, kmeans_plusplus,
                                              mass_weighted_mean, minibatch_step, nearest, squared_distances,
                                              step_statistics, unit_rows, weighted_lloyd)
from conceptlens.concepts.conceptset import ConceptSet

__all__ = ["KMeansConfig", "KMeansState", "KMeansStats", "StreamingKMeans", "apply_step", "batched_seeds",
           "kmeans_plusplus", "mass_weighted_mean", "minibatch_step", "nearest", "squared_distances", "step_statistics",
           "weighted_lloyd"]

class StreamingKMeans(ExtractorBase):
    distributed = "step"
    """Weighted mini-batch k-means with k-means++ start, dead-centre reseeding and merging.

    `encode(x)` is the negative squared distance to each centre (spherical: the cosine
    similarity), so its argmax is `predict(x)`. The first `init_size` rows are buffered, seed
    k-means++ and then form the first minibatches. `concept_set()` on an object still
    buffering initialises a copy on what it has, leaving the object itself unchanged.
    """

    Config, State = KMeansConfig, KMeansState
    method = "kmeans"

    @known_kwargs
    def __init__(self, n_concepts: int, *, spherical: bool = False, batch_size: int | None = None,
                 init_size: int | None = None, reseed_after: float | None = 50.0, seed: int = 0,
                 init: str = "auto", dtype: str = "float32", unit: str = "token",
                 device: str | torch.device | None = None) -> None:
        self.config = KMeansConfig(n_concepts, spherical, batch_size, init_size, reseed_after, seed, init, dtype, unit)
        self._set_device(device)
        self._gen = torch.Generator().manual_seed(seed)
        self.d: int | None = None
        self._centres: Tensor | None = None  # (k, d) weighted running means (not normalised)
        self._mass = torch.zeros(n_concepts, dtype=torch.float64)  # (k,) total weight received
        self._idle = torch.zeros(n_concepts, dtype=torch.int64)  # (k,) rows seen since last mass
        self._pending: tuple[Tensor, Tensor] | None = None  # rows (M, d), weights (M,) before init
        self.n_seen = 0
        self.n_reseeded = 0
        self.n_steps = 0
        self._idle_bound = 0  # host-side upper bound on max(idle): reseeding reads the device only past it

    @property
    def is_initialised(self) -> bool:
        """True once k-means++ has run (after `init_size` rows or `flush()`)."""
        return self._centres is not None

    @property
    def centres(self) -> Tensor:
        """The centres `(k, d)`; unit vectors when spherical."""
        c = self._fitted()[0]
        return _unit(c) if self.config.spherical else c

    @property
    def mass(self) -> Tensor:
        """Total weight `(k,)` each centre has received (float64)."""
        return self._fitted()[1]

    @property
    def wants_tokens(self) -> bool:
        """Whether `fit` must pass `tokens=` (only to pool rows into document means)."""
        return self.config.unit == "document"

    def update(self, x: Tensor, weight: Tensor | None = None, *, tokens: Any = None, validate: bool = True) -> None:
        """Consume rows x `(N, d)` with optional non-negative weights `(N,)` (default 1); with `unit="document"`,
        their means per `tokens.doc` (unweighted). `validate=False` skips the check of the weights, a host
        read of the device, for weights valid by construction (Deleuzian's, every block)."""
        if weight is not None and self.config.unit == "document":
            raise ValueError('unit="document" averages a document\'s rows unweighted; pass no weight')
        x = unit_rows(x, tokens, self.config.unit)
        self._update(*self._check(x, weight, validate))

    def _update(self, x: Tensor, weight: Tensor) -> None:
        """`update` on rows and weights already through `_check`."""
        if self.comm is not None and self._centres is None:  # every rank buffers the same rows
            x, weight = self._gather(x, weight)
        if self.comm is None or self._centres is None:  # (distributed steps count every rank's rows: `_step`)
            self.n_seen += x.shape[0]
        if self._centres is None:
            px, pw = self._pending if self._pending is not None else (x[:0], weight[:0])
            self._pending = (torch.cat([px, x]), torch.cat([pw, weight]))
            if self._pending[0].shape[0] >= self.config.rows_to_init:
                self.flush()
            return
        self._steps(x, weight)

    def _seed_rows(self, x: Tensor, w: Tensor) -> Tensor:
        """`(k,)` indices of the rows that seed the centres."""
        # k-means++ costs O(k N d): seed on the first init_size rows even if more arrived at once.
        head, k = self.config.rows_to_init, self.config.n_concepts
        seeds = batched_seeds if self.config.batched_init and min(head, x.shape[0]) >= k else kmeans_plusplus
        return seeds(x[:head], k, self._gen, w[:head])

    def flush(self) -> None:
        """Initialise now on the buffered rows, if not yet initialised (no-op otherwise)."""
        if self._centres is not None or self._pending is None:
            return
        x, w = self._pending
        if x.shape[0] < self.config.n_concepts:  # k-means++ would repeat rows as centres
            raise NotFittedError(f"StreamingKMeans saw {x.shape[0]:,} rows in all, fewer than "
                                 f"n_concepts={self.config.n_concepts}: give it more rows or fewer concepts")
        self._pending = None
        self._centres = x[self._seed_rows(x, w)].float().clone()  # float32 whatever the rows
        self._mass = self._mass.to(x.device)
        self._idle = self._idle.to(x.device)
        self._steps(x, w, shared=True)  # distributed: these rows are the same on every rank

    def _check(self, x: Tensor, weight: Tensor | None, validate: bool = True) -> tuple[Tensor, Tensor]:
        self._check_width(x)
        x = self._place(x.detach())
        x = (_unit(x.float()) if self.config.spherical else x).to(self.compute_dtype)  # rows in the compute dtype
        if weight is None:
            weight = torch.ones(x.shape[0], device=x.device)
        elif weight.shape != (x.shape[0],):
            raise ValueError(f"weight must have shape ({x.shape[0]},); got {tuple(weight.shape)}")
        elif validate and not bool(torch.isfinite(weight).all() and (weight >= 0).all()):
            raise ValueError("weight must be finite and non-negative")
        return x, weight.detach().float().to(x.device)

    def _steps(self, x: Tensor, w: Tensor, shared: bool = False) -> None:
        """Steps of `batch_size` rows. Distributed (`comm` set, rows not `shared`): each rank
        holds its part of every step, and the ranks take as many steps as the rank with the
        most rows (the others contribute empty parts)."""
        size = self.config.batch_size or max(x.shape[0], 1)
        n = -(-x.shape[0] // size)
        synced = self.comm is not None and not shared
        for i in range(self.comm.max_int(n) if synced else n):
            self._step(x[i * size:(i + 1) * size], w[i * size:(i + 1) * size], synced)

    def _step(self, x: Tensor, w: Tensor, synced: bool = False) -> None:
        centres = self._live()
        view = _unit(centres) if self.config.spherical else centres
        labels, best = nearest(x, view)  # chunked fused matmul + argmin, no (N, k) temporaries
        sums, received = step_statistics(centres, self._mass, x, w, labels)
        rows = x.shape[0]
        if synced:  # the statistics of the whole step, summed over the ranks, before the update
            k, d = sums.shape
            packed = self.comm.sum_(torch.cat([sums.flatten().double(), received.double(),
                                               received.new_tensor([rows], dtype=torch.float64)]))
            sums, received = packed[: k * d].view(k, d).to(sums.dtype), packed[k * d: k * d + k].to(received.dtype)
            rows = int(packed[-1].item())
            self.n_seen += rows
        self._centres, self._mass, received = apply_step(centres, self._mass, sums, received)
        self._idle = torch.where(received > 0, 0, self._idle + rows)
        self.n_steps += 1
        if self.config.reseed_after is not None:
            self._reseed(x, w, best, synced, rows)

    def _gather(self, x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        """Rows and weights of every rank, in rank order (distributed)."""
        both = self.comm.gather_rows(torch.cat([x.float(), w[:, None].float()], 1))
        return both[:, :-1].to(x.dtype), both[:, -1].to(w.dtype)

    def _reseed(self, x: Tensor, w: Tensor, best: Tensor, synced: bool = False, rows: int | None = None) -> None:
        """Move centres idle for too long onto rows drawn in proportion to w * distance^2
        (distributed: drawn from every rank's rows, gathered in rank order). `rows`: the step's
        rows over all ranks, so every rank takes the same early return."""
        limit = self.config.reseed_after * self.config.n_concepts
        self._idle_bound += x.shape[0] if rows is None else rows  # no idle count grows faster than the rows seen
        if self._idle_bound < limit:  # the common case: no centre can be dead, nothing read back
            return
        self._idle_bound = int(self._idle.max())
        if self._idle_bound < limit:
            return
        dead = torch.nonzero(self._idle >= limit).flatten()
        if synced:
            both = self.comm.gather_rows(torch.cat([x.float(), w[:, None], best[:, None]], 1))
            x, w, best = both[:, :-2], both[:, -2], both[:, -1]
        score = (w * best).double().cpu()
        n = min(dead.numel(), int((score > 0).sum()))
        if n == 0:
            return
        picked = torch.multinomial(score, n, replacement=False, generator=self._gen).to(x.device)
        dead, centres = dead[:n], self._live()
        centres[dead] = x[picked].to(centres.dtype)
        self._mass[dead] = 0.0
        self._idle[dead] = 0
        self.n_reseeded += n
        self._idle_bound = int(self._idle.max())

    def _live(self) -> Tensor:
        """The centres `(k, d)` of an initialised object (k-means++ has run)."""
        if self._centres is None:
            raise NotFittedError("StreamingKMeans is not initialised yet; call update(x) or flush() first")
        return self._centres

    def _fitted(self) -> tuple[Tensor, Tensor]:
        """The centres `(k, d)` and masses `(k,)`; of a copy initialised on the rows buffered so far
        when k-means++ has not run yet (the object itself unchanged)."""
        if self._centres is not None:
            return self._centres, self._mass
        if self._pending is None:
            raise NotFittedError("StreamingKMeans has seen no data yet; call update(x) first")
        twin = type(self).from_state(self.state_dict())
        twin.flush()
        state = twin.state()
        assert state.centres is not None  # flush() ran k-means++ on the buffered rows
        return state.centres, state.mass

    def encode(self, x: Tensor) -> Tensor:
        """Concept activations `(N, k)`: -|x - c|^2, or cos(x, c) when spherical."""
        c = self.centres
        x = x.float().to(c.device)
        return _unit(x) @ c.T if self.config.spherical else -squared_distances(x, c)

    def predict(self, x: Tensor) -> Tensor:
        """Index `(N,)` of the nearest centre (largest cosine when spherical)."""
        return self.encode(x).argmax(1)

    def inertia(self, x: Tensor, weight: Tensor | None = None) -> float:
        """Sum of (weighted) squared distances to the nearest centre (unit vectors when spherical)."""
        x = x.float().to(self.centres.device)
        x = _unit(x) if self.config.spherical else x
        d2 = squared_distances(x, self.centres).min(1).values.double()
        return float(d2.sum() if weight is None else (d2 * weight.double().to(d2.device)).sum())

    def stats(self) -> KMeansStats:
        live = float("nan") if self._centres is None else (self._mass > 0).float().mean().item()
        return KMeansStats(self.n_steps, self.n_seen, live, self.n_reseeded)

    def _merge(self, other: StreamingKMeans) -> None:
        """Absorb another run's statistics (`merge` takes an object or its `state_dict()`).

        Two independent runs' centres are not matched, so the 2k centres are clustered back
        to k by weighted k-means (weights = masses); each merged centre is the mass-weighted
        mean of its group and its mass the group's total, so total mass is conserved. This is
        not the same as one run over both streams (no online k-means merge can be); the exact
        combination is per step: `step_statistics` of disjoint shards add up, which is what a
        distributed fit all-reduces before every centre update.
        """
        if any(getattr(other.config, f) != getattr(self.config, f) for f in ("n_concepts", "spherical", "unit")):
            raise ValueError(f"cannot merge {other.config} into {self.config}: "
                             "n_concepts, spherical and unit must match")
        theirs = other.state()
        if theirs.centres is None:
            if theirs.pending is not None:  # rows as `update` left them (document means, for that unit)
                self._update(*self._check(*theirs.pending))
            return
        pending, self._pending = self._pending, None
        if self._centres is None:
            self.d, self._centres, self._mass, self._idle = theirs.d, theirs.centres, theirs.mass, theirs.idle
        else:
            if theirs.d != self.d:
                raise ValueError(f"cannot merge centres of width {theirs.d} into width {self.d}")
            points = torch.cat([self._centres, theirs.centres.to(self._centres.device)])
            mass = torch.cat([self._mass, theirs.mass.to(self._mass.device)])
            self._centres, self._mass = weighted_lloyd(points, mass, self.config.n_concepts, self._gen,
                                                        spherical=self.config.spherical)
            self._idle = torch.zeros_like(self._idle)
        self._idle_bound = int(self._idle.max())  # at merge time only
        self.n_seen += theirs.n_seen
        self.n_steps += theirs.steps
        if pending is not None:
            self._steps(*pending)

    def concept_set(self) -> ConceptSet:
        centres, mass = self._fitted()
        centres = _unit(centres) if self.config.spherical else centres
        return ConceptSet(centres, method=self.method, config=self.config_dict(), stats={"mass": mass.float()},
                          mean=mass_weighted_mean(centres, mass))

    def config_dict(self) -> dict[str, Any]:
        return without_token_unit(super().config_dict())

    def state(self) -> KMeansState:
        """A copy of everything a checkpoint or a merge needs."""
        pending = None if self._pending is None else (self._pending[0].clone(), self._pending[1].clone())
        centres = None if self._centres is None else self._centres.clone()
        return KMeansState(self.d, centres, self._mass.clone(), self._idle.clone(), pending, self.n_seen,
                           self.n_reseeded, self.n_steps, self._gen.get_state())

    def load_state(self, state: KMeansState) -> None:
        """Continue from `state` (copied, on this extractor's device when it has one)."""
        state = self._placed(state)
        self.d, self.n_seen, self.n_reseeded, self.n_steps = state.d, state.n_seen, state.n_reseeded, state.steps
        self._centres = None if state.centres is None else state.centres.clone()
        self._mass, self._idle = state.mass.clone(), state.idle.clone()
        self._pending = None if state.pending is None else (state.pending[0].clone(), state.pending[1].clone())
        self._gen.set_state(state.generator)
        self._idle_bound = int(self._idle.max()) if self._idle.numel() else 0
