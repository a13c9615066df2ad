"""VQCodebook: an online vector-quantisation codebook learned by exponential moving averages.

    vq = VQCodebook(n_codes=512)
    for x in stream:                 # x: (N, d) float32
        vq.update(x)
    vq.assign(x)                     # (N,) nearest code per token
    cs = vq.concept_set()            # directions = the codes

Training follows the EMA codebook of VQ-VAE / VQ-VAE-2: each code is the EMA of the sum of
its assigned tokens divided by the Laplace-smoothed EMA of its count. During training a
token is assigned to one of its `top_k` nearest codes, drawn with probabilities
softmax(-distance / temperature) over the squared Euclidean distances, as the CLVQ-VAE's released
quantiser (`distance="euclidean"`: over Euclidean ones, as codebooks saved before that option;
such a checkpoint resumes as it was fitted); evaluation (`assign`, `encode`, `quantize`) always
takes the nearest code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from conceptlens._checks import known_kwargs
from conceptlens.concepts.base import ExtractorBase, NotFittedError, map_tensors
from conceptlens.concepts.buffer import MixingBuffer
from conceptlens.concepts.conceptset import ConceptSet
# the config, result and state types, the math and the merge live in vq_config.py, vq_math.py and
# vq_merge.py; the public names are re-exported here
from conceptlens.concepts.vq_config import CodebookState, SharedStart, VQConfig, VQState, VQStats, VQStep
from conceptlens.concepts.vq_math import (INIT_METHODS, InitMethod, codes_from_ema, ema_update, fvu_from_sums,
                                          fvu_sums, initial_codes, laplace_smooth, perplexity, sample_top_k,
                                          sampled_distances, samples_randomly)
from conceptlens.concepts.vq_merge import merge_codebooks

__all__ = ["CodebookState", "INIT_METHODS", "InitMethod", "SharedStart", "VQCodebook", "VQConfig", "VQState", "VQStats",
           "VQStep", "codes_from_ema", "ema_update", "fvu_from_sums", "fvu_sums", "initial_codes", "laplace_smooth",
           "perplexity", "sample_top_k", "samples_randomly"]


class VQCodebook(ExtractorBase):
    """An EMA vector-quantisation codebook fitted online; see the module docstring.

    The first init_size tokens initialise the codes (k-means, spherical k-means or random
    tokens); then each call is one EMA step, or, with batch_size, each batch_size rows
    drawn from a mixing buffer are; `flush()` at the end of the stream trains on the rest.
    Every reseed_after steps, codes whose EMA count fell below reseed_threshold * N / K
    restart at random tokens of the latest batch. `merge(other)` adds what the other codebook
    learnt since the state both started from (see `conceptlens.concepts.vq_merge`).
    """

    Config, State = VQConfig, VQState
    legacy_config = {"distance": "euclidean"}
    method = "vq"
    distributed = "step"

    @known_kwargs
    def __init__(self, n_codes: int, *, decay: float = 0.99, eps: float = 1e-5, top_k: int = 5,
                 temperature: float = 1.0, init: InitMethod = "kmeans", init_size: int | None = None,
                 reseed_after: int | None = 100, reseed_threshold: float = 0.03,
                 batch_size: int | None = None, buffer_size: int | None = None, seed: int = 0,
                 dtype: str = "float32", distance: str = "squared",
                 device: str | torch.device | None = None) -> None:
        self.config = VQConfig(n_codes, decay, eps, top_k, temperature, init, init_size,
                               reseed_after, reseed_threshold, batch_size, buffer_size, seed, dtype, distance)
        self._set_device(device)
        self.d: int | None = None
        self.fitted: CodebookState | None = None
        self._pending: Tensor | None = None   # rows collected for the initialisation
        self._init_calls = 0
        self.steps = 0
        self.tokens = 0
        # One CPU generator for every draw, so CPU and GPU runs see the same random numbers.
        self._gen = torch.Generator().manual_seed(seed)
        size = self.config.buffer_size or 4 * (batch_size or 1)
        self._mixer = MixingBuffer(size, seed=seed + 1) if batch_size else None   # its own stream
        self._origin: SharedStart | None = None   # the state replicas share (see `merge`)

    @property
    def is_initialised(self) -> bool:
        return self.fitted is not None

    @property
    def codes(self) -> Tensor:
        """The codes (K, d)."""
        return self._fitted().codes

    @property
    def counts(self) -> Tensor:
        """EMA assignment counts (K,)."""
        return self._fitted().counts

    # ---- streaming -------------------------------------------------------------------

    def update(self, x: Tensor) -> None:
        """Consume `x` (N, d): collect until init_size tokens, then one EMA step per call, or
        per batch_size rows drawn from the mixing buffer."""
        self._consume(self._prepare(x))

    def _consume(self, x: Tensor) -> None:
        """`update` on rows already through `_prepare`."""
        shared = False  # distributed: rows gathered from every rank (the same everywhere)
        if self.fitted is None:
            if self.comm is not None:
                x, shared = self.comm.gather_rows(x), True
            self._init_calls += 1
            pending = self._pending = torch.cat([self._pending, x]) if self._pending is not None else x
            if len(pending) < self.config.rows_to_init:
                return
            x = pending[self.config.rows_to_init:]
            self._initialise(pending[: self.config.rows_to_init])
        size = self.config.batch_size
        if self._mixer is None or size is None:
            if len(x) or (self.comm is not None and not shared):
                self.train_step(x, shared=shared)
            return
        if not shared or self.comm.rank == 0:  # gathered leftover rows join one buffer only
            self._mixer.add(x)
        if self.comm is not None:  # as many steps on every rank; short ranks add empty batches
            for _ in range(self.comm.max_int(self._mixer.ready(size))):
                batch = self._mixer.take(size)
                self.train_step(batch.to(x.device) if batch is not None else x[:0])
            return
        while (batch := self._mixer.take(size)) is not None:
            self.train_step(batch.to(x.device))

    def flush(self) -> None:
        """End of stream: initialise on what was collected (if at least n_codes tokens) and
        train on the rows left in the mixing buffer (the last batch may be short)."""
        if self.fitted is None and self._pending is not None and len(self._pending) >= self.config.n_codes:
            self._initialise(self._pending)
        size = self.config.batch_size
        if self.fitted is None or self._mixer is None or size is None:
            return
        rest = self._mixer.drain()
        batches = [] if rest is None else list(rest.split(size))
        n = len(batches) if self.comm is None else self.comm.max_int(len(batches))
        device = self.fitted.codes.device
        for i in range(n):
            self.train_step(batches[i].to(device) if i < len(batches) else self.fitted.codes[:0])

    def train_step(self, x: Tensor, shared: bool = False) -> VQStep:
        """One EMA step on the batch `x` (N, d): sample codes, update counts and sums,
        track statistics, reseed dead codes every reseed_after steps. Distributed (`comm`
        set, rows not `shared`): x is this rank's part of the step; the uniforms are this
        rank's slice of the whole step's, and the statistics are all-reduced before the EMA
        update, so the step equals one on all ranks' rows in rank order."""
        cfg, fit = self.config, self._fitted()
        x, codes = self._prepare(x), fit.codes
        synced = self.comm is not None and not shared
        # bfloat16: the matmul shifted by the codes' mean, which every rank has (its own rows' mean would
        # round each rank's part of a step otherwise than one process rounds the whole step)
        shift = codes.mean(0) if x.dtype != torch.float32 and cfg.distance == "squared" else None  # (old rule: Euclidean)
        dist = sampled_distances(x, codes, cfg, shift)                 # (N, K)
        u = None
        if synced:
            sizes = self.comm.sizes(len(x))
            if samples_randomly(cfg.top_k, cfg.temperature, cfg.n_codes):
                start = sum(sizes[: self.comm.rank])
                u = torch.rand(sum(sizes), 1, generator=self._gen)[start:start + len(x)]
        code = sample_top_k(dist, cfg.top_k, cfg.temperature, self._gen, u)
        # per-code counts and sums by scatter-add: O(N d), where a one-hot matmul is O(N K d)
        counts = torch.zeros_like(fit.counts).index_add_(0, code, x.new_ones(len(x)).to(fit.counts.dtype))  # (K,)
        sums = torch.zeros_like(fit.sums).index_add_(0, code, x.to(fit.sums.dtype))                          # (K, d)
        nearest = dist.argmin(1)
        hits = torch.zeros_like(fit.hits).index_add_(0, nearest, torch.ones_like(nearest).to(fit.hits.dtype))
        fvu = fvu_sums(x, codes[nearest])
        n_rows = len(x)
        if synced:
            counts, sums, hits, fvu = self._all_reduce(counts, sums, hits, fvu)
            n_rows = sum(sizes)
        fit.counts, fit.sums = ema_update(fit.counts, fit.sums, counts, sums, cfg.decay)
        fit.codes = codes_from_ema(fit.counts, fit.sums, cfg.eps)
        fit.hits += hits
        fit.fvu = cfg.decay * fit.fvu + (1 - cfg.decay) * fvu
        self.steps += 1
        self.tokens += n_rows
        if cfg.reseed_after and self.steps % cfg.reseed_after == 0:
            self._reseed(fit, x, synced)
        return VQStep(code, codes[code])

    def _all_reduce(self, counts: Tensor, sums: Tensor, hits: Tensor, fvu: Tensor) -> tuple[Tensor, ...]:
        """One step's statistics summed over the ranks (one all-reduce, float64)."""
        parts = [counts, sums, hits, fvu]
        flat = self.comm.sum_(torch.cat([p.flatten().double() for p in parts]))
        out, offset = [], 0
        for p in parts:
            out.append(flat[offset:offset + p.numel()].view_as(p).to(p.dtype))
            offset += p.numel()
        return tuple(out)

    def _prepare(self, x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """`x` checked, placed and in `dtype` (None: the compute dtype)."""
        self._check_width(x)
        x = self._place(x).to(dtype or self.compute_dtype)
        return x if self.fitted is None else x.to(self.fitted.codes.device)

    def _initialise(self, x: Tensor) -> None:
        """Codes from the first init_size tokens x (M, d); EMA state consistent with them."""
        cfg = self.config
        x = x.float()  # the initial k-means and the EMA state are float32 whatever the compute dtype
        centres, labels = initial_codes(x, cfg.n_codes, cfg.init, self._gen)
        # EMA counts live on the scale of tokens per step, so the initial clusters weigh
        # like one batch.
        rows_per_step = cfg.batch_size or len(x) / max(self._init_calls, 1)
        self.fitted = CodebookState.from_clusters(centres, labels, rows_per_step, cfg.eps)
        self._pending = None
        self.mark_shared_start()

    def mark_shared_start(self) -> None:
        """Declare the current state the start of replicas (call it before handing out its
        `state_dict`), so that their later `merge` counts it once. Initialisation and merge
        mark it by themselves."""
        self._origin = None if self.fitted is None else SharedStart.of(self.fitted, self.steps, self.tokens)

    def _reseed(self, fit: CodebookState, x: Tensor, synced: bool = False) -> None:
        """Replace dead codes by random tokens of the latest batch `x` (N, d) (distributed:
        of every rank's part of it, in rank order)."""
        cfg = self.config
        share = fit.counts.sum() / cfg.n_codes
        dead = torch.nonzero(fit.counts < cfg.reseed_threshold * share).squeeze(1)
        if dead.numel() == 0:
            return
        if synced:
            x = self.comm.gather_rows(x)
        if len(x) == 0:
            return
        if len(x) >= len(dead):
            pick = torch.randperm(len(x), generator=self._gen)[: len(dead)]
        else:
            pick = torch.randint(len(x), (len(dead),), generator=self._gen)
        # A reborn code starts with a uniform share, so it is not reseeded again at once.
        fit.counts[dead] = share
        fit.sums[dead] = x[pick.to(x.device)] * laplace_smooth(fit.counts, cfg.eps)[dead, None]
        fit.codes = codes_from_ema(fit.counts, fit.sums, cfg.eps)

    # ---- evaluation ------------------------------------------------------------------

    def assign(self, x: Tensor) -> Tensor:
        """Nearest code per token: (N, d) -> (N,) long."""
        codes = self._fitted().codes
        return torch.cdist(self._prepare(x, torch.float32), codes).argmin(1)

    def encode(self, x: Tensor) -> Tensor:
        """One-hot nearest-code assignment (N, d) -> (N, K) float, the concept activations."""
        return F.one_hot(self.assign(x), self.config.n_codes).float()

    def quantize(self, x: Tensor) -> Tensor:
        """Each token replaced by its nearest code: (N, d) -> (N, d)."""
        return self._fitted().codes[self.assign(x)]

    def stats(self) -> VQStats:
        """Usage, perplexity and quantisation FVU for the fit report (nan before init)."""
        if self.fitted is None:
            return VQStats(float("nan"), float("nan"), float("nan"), self.steps, self.tokens)
        counts = self.counts  # (a sharded codebook's gathered from every rank)
        share = counts.sum() / self.config.n_codes
        usage = (counts >= self.config.reseed_threshold * share).float().mean().item()
        return VQStats(usage, perplexity(counts).item(), fvu_from_sums(self.fitted.fvu), self.steps,
                       self.tokens)

    def concept_set(self) -> ConceptSet:
        """Directions = the codes (K, d) in the input's activation space."""
        fit = self._fitted()
        config = {**self.config_dict(), "fit_stats": self.stats()._asdict()}
        return ConceptSet(fit.codes.clone(), method=self.method, config=config,
                          encoder={"codebook": fit.codes.clone()},
                          stats={"ema_count": fit.counts.clone(), "hits": fit.hits.clone()},
                          mean=fit.sums.sum(0) / fit.counts.sum())  # EMA mean of the activations

    def _fitted(self) -> CodebookState:
        if self.fitted is None:
            seen = 0 if self._pending is None else len(self._pending)
            raise NotFittedError(f"the codebook is not initialised: it has seen {seen} tokens and "
                               f"initialises after init_size={self.config.rows_to_init} (or at flush())")
        return self.fitted

    # ---- state: checkpoints and merges ----------------------------------------------

    def state(self) -> VQState:
        """A copy of everything a checkpoint or a merge needs."""
        mixer = None if self._mixer is None else self._mixer.state_dict()
        return map_tensors(VQState(self.d, self.fitted, self._pending, self._init_calls, self.steps, self.tokens,
                                   self._gen.get_state(), self._origin, mixer), torch.clone)

    def load_state(self, state: VQState) -> None:
        """Continue from `state` (copied, on this extractor's device when it has one)."""
        state = map_tensors(self._placed(state), torch.clone)
        self.d, self.fitted, self._pending, self._origin = state.d, state.fitted, state.pending, state.origin
        self._init_calls, self.steps, self.tokens = state.init_calls, state.steps, state.tokens
        self._gen.set_state(state.generator)
        if self._mixer is not None and state.mixer is not None:  # (a state without one leaves it as it is)
            self._mixer.load_state_dict(state.mixer)

    def _merge(self, other: VQCodebook) -> None:
        """Add another worker's EMA statistics (see `conceptlens.concepts.vq_merge`)."""
        if other.config.n_codes != self.config.n_codes or (self.d and other.d and other.d != self.d):
            raise ValueError(f"cannot merge a codebook of {other.config.n_codes} codes of width "
                             f"{other.d} into one of {self.config.n_codes} codes of width {self.d}")
        mine = self._pending if self.fitted is None else None  # rows waiting for the initialisation:
        theirs = other._pending if other.fitted is None else None  # none of them is dropped
        if other.fitted is not None:
            if self.fitted is None:  # it becomes a copy of the other, then takes its own waiting rows
                self.check_state({"config": other.config_dict()})
            self.load_state(merge_codebooks(self.state(), other.state(), self.config.decay, self.config.eps))
            if mine is not None:
                self._consume(mine)
        elif theirs is not None:
            self._consume(theirs.to(self._pending.device if self._pending is not None else theirs.device))
