"""Deleuzian: concepts as clusters of pairwise activation differences, weighted by skewness.

    dz = Deleuzian(n_concepts=512, seed=0)
    for x in stream:                  # x: (N, d) float32
        dz.update(x)
    cs = dz.concept_set()             # centroids of the sign-aligned differences
    acts = dz.encode(x)               # x @ C.T, (N, 512)

Tokens pass through a MixingBuffer; each block drawn from it is paired along a derangement
(every token once as a, once as b), giving differences d = x_a - x_b. Each d is oriented so
that the activations projected on it are positively skewed (a concept is "present" on its
positive side), weighted by 1 / |skewness|, and fed to a weighted StreamingKMeans. Skewness
is measured on a reservoir sample of the activations seen so far.

What the weights do: a few rare, huge, heavy-tailed directions (massive activations) have
large skewness and would otherwise take many centroids; 1/|g| takes them off, so the
centroids spread over more directions. The same weights favour symmetric contrasts: with
sparse on/off concepts of equal frequency, c_i - c_j projects symmetrically (g ~ 0) and
outweighs the single-concept differences, so `skew_weighting=False` recovers such planted
concepts more exactly (see tests/concepts/test_deleuzian.py).

Two modes. `mode="paper"` reproduces the paper's released code (`diffs` in
ClementCornet/Deleuzian-Hypothesis): each row is the left end of one difference with a
uniform partner (here: from its block of the mixing buffer, with replacement, where the
paper draws from the whole data set), the differences are kept (all of them up to
`max_differences`, then a uniform sample), and at `flush` each is oriented and weighted by its
skewness over all samples (the activation reservoir for the others, its own two endpoints
exactly; the paper's values whenever the stream fits in `reference_size`), then clustered by
weighted k-means++ and Lloyd (up to `max_iter`). Memory: max_differences x d.
`mode="streaming"` (the default) stays one-pass with memory independent of the stream: one
mini-batch k-means step per block, skewness over the reservoir only. What it gives up: (a)
mini-batch k-means seeded on the first blocks instead of full k-means, so rare, huge
differences that full k-means isolates are absorbed; (b) skewness without the endpoints, so a
difference touching an outlier token gets |g| ~ 0.2 (weight ~ 5) instead of ~ 23 (weight
0.04). On SmolLM2 block 15 at k = 128 this is the difference between a 1.7-2.0x (paper
algorithm) and a 1.2x effective-rank gain from skew weighting; (c) each block's skewness is
measured on `skew_rows` rows drawn afresh from the reservoir (default max(k, 256)), not on all
`reference_size`, so that it costs what the block's k-means step costs instead of 8x (R 4096,
k 512). Measured on 57,344 SmolLM2 block-15 rows (benchmarks/deleuzian_skew.py): against the
weights of the same differences over 32,768 held-out rows, the Spearman correlation of 1/|g| is
0.79 at 512 rows vs 0.96 over the whole 4096-row reservoir (0.88 at 1024, 0.69 at 256), and
91% of the differences are oriented as the whole reservoir orients them; the final concepts
(k 512) keep the weighting's effective rank (292 / 287 over two seeds vs 291 / 288 with the
whole reservoir, 261 unweighted) and differ from the whole-reservoir concepts less than a
change of seed does (mean matched cosine 0.58 with the same blocks vs 0.46 between seeds).
Probe loss (reproductions/deleuzian_probe.py, bbc-news document means, k 256) does not
suffer from these: streaming 0.245 / 0.216 against paper mode 0.297 / 0.247 on MiniLM block 5 /
SmolLM2 block 15, both below the TopK SAE's 0.442 / 0.307; on SmolLM2 wsj-pos tokens (k 512)
0.133 against 0.131 (SAE 0.191). Nor at the demo's short budget (reproductions/deleuzian_demo.py:
40k bbc-news tokens, k 128, 20 k-means steps, probed on held-out document means): streaming
0.318 against paper mode 0.306, where both lose to the TopK SAE (0.206) in either mode.
What was lost there is the unit, not the mode: fitted on the means of the same 320 documents
(`unit="document"`, the paper's unit, what the demo uses), the paper mode reaches 0.203 on
train-split articles outside the fit (TopK SAE 0.252); streaming on them reaches only 0.239, since
one mini-batch pass over as few samples as concepts does not settle as full k-means does.
A shared Gram product (x_ref . x_i - x_ref . x_j) would not help here: each row is in two
differences, so projecting the rows costs as much as projecting the differences.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from conceptlens._checks import known_kwargs
from conceptlens.concepts.base import ExtractorBase, NotFittedError
from conceptlens.concepts.buffer import MixingBuffer
from conceptlens.concepts.conceptset import ConceptSet
# the config, the stats and the state live in deleuzian_config.py; re-exported here
from conceptlens.concepts.deleuzian_config import MODES, DeleuzianConfig, DeleuzianState, DeleuzianStats
from conceptlens.concepts.deleuzian_math import oriented_differences, reservoir_update, skewness
from conceptlens.concepts.deleuzian_paper import DifferenceReservoir, PaperFit, paper_clusters
from conceptlens.concepts.kmeans import StreamingKMeans
from conceptlens.concepts.kmeans_config import without_token_unit
from conceptlens.concepts.kmeans_math import unit_rows

__all__ = ["Deleuzian", "DeleuzianConfig", "DeleuzianState", "DeleuzianStats", "MODES", "oriented_differences",
           "reservoir_update", "skewness"]


class Deleuzian(ExtractorBase):
    """Online Deleuzian concept extraction: weighted k-means of oriented pairwise differences.

    Concepts are the centroids C `(k, d)`; `encode(x) = x @ C.T`. Differences are made in
    blocks of `batch_size` drawn from a mixing buffer of `buffer_size` tokens; tokens still in
    the buffer are paired when the concepts are read (on a copy: reading changes nothing).
    """

    Config, State = DeleuzianConfig, DeleuzianState
    method = "deleuzian"
    distributed = "step"

    @known_kwargs
    def __init__(self, n_concepts: int, *, reference_size: int = 4096, buffer_size: int = 16384,
                 batch_size: int = 2048, skew_weighting: bool = True, reseed_after: float | None = 50.0,
                 seed: int = 0, mode: str = "streaming", max_differences: int = 65536, max_iter: int = 300,
                 skew_rows: int | None = None, dtype: str = "float32", unit: str = "token",
                 device: str | torch.device | None = None) -> None:
        self.config = DeleuzianConfig(n_concepts, reference_size, buffer_size, batch_size, skew_weighting,
                                      reseed_after, seed, mode, max_differences, max_iter, skew_rows, dtype, unit)
        self._set_device(device)
        self._gen = torch.Generator().manual_seed(seed)
        self.buffer = MixingBuffer(buffer_size, seed=seed + 1)
        self.kmeans = StreamingKMeans(n_concepts, reseed_after=reseed_after, seed=seed + 2, device=device,
                                      dtype=self.config.dtype)
        self.d: int | None = None
        self._reference: Tensor | None = None  # (reference_size, d) reservoir sample
        self.n_seen = 0
        self._ready: tuple[int, StreamingKMeans | PaperFit] | None = None  # cached flushed copy for reading
        self.differences = DifferenceReservoir(max_differences, seed=seed + 3)  # paper mode only
        self._paper: PaperFit | None = None  # paper mode: the clusters computed at the last flush

    @property
    def comm(self):  # noqa: ANN201 - a conceptlens.distributed.Comm or None
        """Distributed fits synchronise the inner k-means (its statistics are all-reduced per step)."""
        return self.kmeans.comm

    @comm.setter
    def comm(self, value) -> None:  # noqa: ANN001
        if value is not None and self.config.mode == "paper":
            raise ValueError("Deleuzian(mode='paper') clusters its differences once, at the flush, from one "
                             "process's reservoirs: it has no per-step statistics to all-reduce. Give every rank "
                             "the same rows (fit(..., distributed=True)), or use mode='streaming' with comm")
        self.kmeans.comm = value

    @property
    def reference(self) -> Tensor:
        """The reservoir sample `(min(n_seen, reference_size), d)` used for skewness."""
        if self._reference is None:
            raise NotFittedError("Deleuzian has seen no data yet; call update(x) first")
        return self._reference[: min(self.n_seen, self.config.reference_size)]

    @property
    def wants_tokens(self) -> bool:
        """Whether `fit` must pass `tokens=` (only to pool rows into document means)."""
        return self.config.unit == "document"

    def update(self, x: Tensor, tokens: Any = None) -> None:
        """Consume activations x `(N, d)` (with `unit="document"`, their means per `tokens.doc`)."""
        x = unit_rows(x, tokens, self.config.unit)
        self._check_width(x)
        if self._reference is None:  # the first rows
            self._reference = self._place(x.new_zeros(self.config.reference_size, x.shape[1], dtype=self._storage))
        x = self._place(x.detach()).to(self._storage)
        self.n_seen = reservoir_update(self._reference, self.n_seen, x, self._gen)
        self.buffer.add(x)
        if self.comm is not None:  # as many k-means steps on every rank; short ranks add empty blocks
            size = self.config.batch_size
            for _ in range(self.comm.max_int(self.buffer.ready(size))):
                block = self.buffer.take(size)
                self._step(block if block is not None else x[:0])
            return
        while (block := self.buffer.take(self.config.batch_size)) is not None:
            self._step(block)

    def _step(self, block: Tensor) -> None:
        # The mixing buffer lives on the CPU; pairing and k-means run where the activations came from.
        if self.config.mode == "paper":  # each row once on the left, a uniform partner on the right
            block = block.to(self.reference.device).float()
            other = block[torch.randint(block.shape[0], (block.shape[0],), generator=self._gen).to(block.device)]
            diff = block - other
            self.differences.add(diff, (block * diff).sum(1), (other * diff).sum(1))
            self._paper = None
            return
        diff, weight = oriented_differences(block.to(self.reference.device), self._skew_reference(),
                                            self.config.skew_weighting)
        self.kmeans.update(diff, weight, validate=False)  # weights finite and >= 0 by construction: no host read

    @property
    def _storage(self) -> torch.dtype:
        """dtype of the buffered and reservoir rows: the compute dtype, float32 in paper mode."""
        return torch.float32 if self.config.mode == "paper" else self.compute_dtype

    def _skew_reference(self) -> Tensor:
        """The reservoir rows this block's skewness is measured on: `rows_for_skewness` of them,
        drawn uniformly without replacement (all of them while the reservoir holds no more)."""
        ref, rows = self.reference, self.config.rows_for_skewness
        if ref.shape[0] <= rows:
            return ref
        pick = torch.randperm(ref.shape[0], generator=self._gen)[:rows]
        return ref[pick.to(ref.device)]

    def flush(self) -> None:
        """Pair what is left in the buffer and initialise the k-means if it has not yet."""
        rest = self.buffer.drain()
        blocks = [] if rest is None else [b for b in rest.split(self.config.batch_size) if b.shape[0] >= 2]
        n = len(blocks) if self.comm is None or self.d is None else self.comm.max_int(len(blocks))
        for i in range(n):
            self._step(blocks[i] if i < len(blocks) else self.reference[:0])
        if self.config.mode == "paper":
            if self._paper is None and len(self.differences):
                gen = torch.Generator().manual_seed(self.config.seed + 2)
                centres, mass = paper_clusters(self.differences, self.reference, self.n_seen, self.config.n_concepts,
                                               gen, self.config.skew_weighting, self.config.max_iter)
                self._paper = PaperFit(centres, mass)
            return
        self.kmeans.flush()

    def _fitted(self) -> StreamingKMeans | PaperFit:
        """The inner k-means (paper mode: the flushed clusters) as after `flush()`, without
        changing this object."""
        paper = self.config.mode == "paper"
        inner = self._paper if paper else self.kmeans
        if len(self.buffer) == 0 and inner is not None and (paper or self.kmeans.is_initialised):
            return inner
        if self._ready is None or self._ready[0] != self.n_seen:
            twin = type(self).from_state(self.state_dict())
            twin.flush()
            fitted = twin._paper if paper else twin.kmeans
            if fitted is None:  # paper mode without differences
                raise NotFittedError("Deleuzian (paper mode) has no differences yet; call update(x) first")
            self._ready = (self.n_seen, fitted)
        return self._ready[1]

    @property
    def centroids(self) -> Tensor:
        """The concepts C `(k, d)`."""
        return self._fitted().centres

    def encode(self, x: Tensor) -> Tensor:
        """Concept activations `(N, k)` = x @ C.T."""
        c = self.centroids
        return x.float().to(c.device) @ c.T

    def stats(self) -> DeleuzianStats:
        return DeleuzianStats(self.n_seen, len(self.buffer), self.kmeans.stats())

    def _merge(self, other: Deleuzian) -> None:
        """Absorb another run (`merge` takes an object or its `state_dict()`): k-means merged
        as in `StreamingKMeans.merge`, reservoirs pooled in proportion to rows seen, buffers joined."""
        if other.config.n_concepts != self.config.n_concepts:
            raise ValueError(f"cannot merge {other.config.n_concepts} concepts into {self.config.n_concepts}")
        if other.d is None:
            return
        if self.d is None:
            self.d = other.d
            self._reference = other.reference.new_zeros(self.config.reference_size, self.d)
        if other.d != self.d:
            raise ValueError(f"cannot merge a Deleuzian of width {other.d} into width {self.d}")
        self._merge_reference(other)
        self.kmeans.merge(other.kmeans)
        self.differences.merge(other.differences)
        self._paper = None
        leftover = other.buffer.state_dict()["data"]
        if leftover is not None and leftover.shape[0] > 0:
            self.buffer.add(leftover)
            while (block := self.buffer.take(self.config.batch_size)) is not None:
                self._step(block)
        self._ready = None

    def _merge_reference(self, other: Deleuzian) -> None:
        """Pool the reservoirs into one uniform-looking sample of both streams."""
        size = self.config.reference_size
        mine, theirs = self.reference, other.reference.to(self.reference.device)
        total = self.n_seen + other.n_seen
        if mine.shape[0] + theirs.shape[0] <= size:
            pooled = torch.cat([mine, theirs])
        else:
            n_mine = min(mine.shape[0], max(size - theirs.shape[0], round(size * self.n_seen / total)))
            pick_mine = torch.randperm(mine.shape[0], generator=self._gen)[:n_mine]
            pick_theirs = torch.randperm(theirs.shape[0], generator=self._gen)[: size - n_mine]
            pooled = torch.cat([mine[pick_mine.to(mine.device)], theirs[pick_theirs.to(mine.device)]])
        self._reference = mine.new_zeros(size, mine.shape[1])  # mine: a view of the old reservoir
        self._reference[: pooled.shape[0]] = pooled
        self.n_seen = total  # pooled holds min(total, size) rows, as after `total` updates

    def concept_set(self) -> ConceptSet:
        fitted = self._fitted()
        return ConceptSet(fitted.centres, method=self.method, config=self.config_dict(),
                          stats={"mass": fitted.mass.float()}, mean=self.reference.double().mean(0))

    def state(self) -> DeleuzianState:
        """A copy of everything a checkpoint or a merge needs."""
        reference = None if self._reference is None else self.reference.clone()
        return DeleuzianState(self.d, self.n_seen, reference, self._gen.get_state(), self.buffer.state_dict(),
                              self.kmeans.state(), self.differences.state_dict())

    def config_dict(self) -> dict[str, Any]:
        return without_token_unit(super().config_dict())

    def load_state(self, state: DeleuzianState) -> None:
        """Continue from `state` (copied, on this extractor's device when it has one)."""
        state = self._placed(state)
        self.d, self.n_seen = state.d, state.n_seen
        self._reference = None
        if (ref := state.reference) is not None:
            self._reference = ref.new_zeros(self.config.reference_size, ref.shape[1])
            self._reference[: ref.shape[0]] = ref
        self._gen.set_state(state.generator)
        self.buffer.load_state_dict(state.buffer)
        self.kmeans.load_state(state.kmeans)
        if state.differences is not None:  # (states saved before paper mode have none)
            self.differences.load_state_dict(state.differences)
        self._ready, self._paper = None, None

    def state_dict(self) -> dict[str, Any]:
        return self.state().to_dict(self.config_dict(), self.kmeans.config_dict())
