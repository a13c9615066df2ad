"""SAETrainer: the streaming training of an SAE module (mixing buffer, warm-up, Adam, statistics).

    sae = TopKSAE(width=4608, k=32, seed=0)   # the module: parameters, buffers, the model's math
    sae.trainer                               # its trainer, made with it: sae.update / flush / stats call it
    for x in stream:                          # x: (N, d) raw activations
        sae.trainer.update(x)                 # buffer the rows; one Adam step per batch_size mixed rows
    sae.trainer.flush()
    sae.trainer.state()                       # TrainerState: what resumes it bit for bit

The first `warmup_tokens` rows fix the module's input scale (E||s x||^2 = d); every step then
draws `batch_size` rows from the mixing buffer, normalises them, and takes one Adam step on the
module's loss, with the decoder rows' radial gradient removed and the rows renormalised
(`unit_decoder`). With `sae.comm` set (each rank fed its own rows) a step all-reduces the
gradients, firing counts and statistics, so every rank keeps the same parameters (see ddp.py).
The trainer reads the module only through `Trainable`.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import Tensor

from conceptlens.concepts.base import NotFittedError
from conceptlens.concepts.buffer import MixingBuffer
from conceptlens.concepts.sae import ddp
from conceptlens.concepts.sae.persist import TrainerState, WarmUp
from conceptlens.concepts.sae.stats import LatentTracker, RunningStats, SAEStats
from conceptlens.concepts.sae.trainable import Code, Trainable


class SAETrainer:
    """Trains one SAE module on a stream of rows; owns all the state that only training needs."""

    def __init__(self, sae: Trainable) -> None:
        self.sae = sae
        config = sae.config
        self.generator = torch.Generator().manual_seed(sae.seed)
        """The initialisation's random draws (a variant's `_init_params` reads it)."""
        self.mixer = MixingBuffer(size=config.mixing_size(), seed=sae.seed)
        self.warm = WarmUp()
        self.optimizer: torch.optim.Adam | None = None
        """Adam over the module's parameters, made at the first step (or restored from a state)."""
        self.tracker = LatentTracker(config.width, config.dead_after)
        self.running = RunningStats()

    # ---- streaming -------------------------------------------------------------------
    def update(self, x: Tensor) -> None:
        """Buffer the rows of `x` `(N, d)`; take one Adam step per `batch_size` mixed rows."""
        sae = self.sae
        first, device = sae.d is None, sae.tensor_device
        x = sae.check_input(x)
        if first or sae.tensor_device != device:  # the records live with the module's tensors
            self._place_tracker()
        if sae.scale is None:
            self._warm_up(x)
        self.mixer.add(x)
        if sae.scale is None:
            return
        size = sae.config.batch_size
        if sae.comm is not None:  # every rank takes as many steps as the rank with the most rows
            for _ in range(sae.comm.max_int(self.mixer.ready(size))):
                batch = self.mixer.take(size)
                self.step(batch if batch is not None else x[:0])
            return
        while (batch := self.mixer.take(size)) is not None:
            self.step(batch)

    def flush(self) -> None:
        """Train on everything still buffered (the last batch may be short); call at stream end."""
        sae = self.sae
        if sae.scale is None and self.warm.rows > 0:
            self._set_scale()
        rest = self.mixer.drain() if sae.scale is not None else None
        batches = [] if rest is None else list(rest.split(sae.config.batch_size))
        n = len(batches) if sae.comm is None or sae.d is None else sae.comm.max_int(len(batches))
        for i in range(n):
            self.step(batches[i] if i < len(batches) else torch.zeros(0, sae.d or 0))

    def stats(self) -> SAEStats:
        """Steps, tokens, the last step's FVU / L0 / dead fraction / loss, and their running means."""
        return self.running.summary()

    def _place_tracker(self) -> None:
        state = self.tracker.state_dict()
        self.tracker = LatentTracker(self.sae.config.width, self.sae.config.dead_after, self.sae.tensor_device)
        self.tracker.load_state_dict(state)

    def _warm_up(self, x: Tensor) -> None:
        sae = self.sae
        rows = x[: sae.config.warmup_tokens - self.warm.rows]
        sae._warm_up(rows)
        sum_sq, n = rows.double().pow(2).sum().cpu(), rows.shape[0]
        if sae.comm is not None:  # the warm-up sums of every rank: one scale for all
            total = sae.comm.sum_(torch.stack([sum_sq, torch.tensor(n * 1.0, dtype=torch.float64)]))
            sum_sq, n = total[0], int(total[1])
        self.warm = WarmUp(self.warm.sum_sq + float(sum_sq), self.warm.rows + n)
        if self.warm.rows >= sae.config.warmup_tokens:
            self._set_scale()

    def _set_scale(self) -> None:
        self.sae._set_scale(self.warm.sum_sq, self.warm.rows)

    # ---- one optimiser step ---------------------------------------------------------
    def step(self, batch: Tensor) -> None:
        """One Adam step on the raw rows `batch` `(B, d)` (B may be 0 on a rank without rows)."""
        sae = self.sae
        x = sae._normalise(batch.to(sae.tensor_device).float())  # (B, d), float32 (the loss's target)
        if sae.comm is not None:
            self._distributed_step(x)
            return
        if self.optimizer is None:
            self._start(x)
        w = sae._compute_weights()
        x, code, x_hat = sae._forward(x, w)  # target (B, d), code, x_hat (B, d)
        loss = sae._recon_loss(x, code, x_hat, w) + sae._penalty(x, x_hat, code, w)
        self.optimiser().zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            self._apply_gradients()
            self._record(x, x_hat, sae._counted(code), loss)
            sae._after_step(code)

    def _distributed_step(self, x: Tensor) -> None:
        """One step synchronised over the ranks (see ddp.py); `x` `(n, d)` this rank's normalised rows."""
        sae, comm, n, width = self.sae, self.sae.comm, x.shape[0], self.sae.config.width
        if self.optimizer is None:  # every rank creates Adam, then takes the first rank-with-rows' tensors
            self._start(x if n else x.new_zeros(1, x.shape[1]))
            ddp.broadcast_first(comm, [*sae.params.values(), *sae.buffer_dict.values()], n > 0)
        w = sae._compute_weights()
        self.optimiser().zero_grad(set_to_none=True)
        # the step's numbers: squared error, squared norm, loss * n, then the rows' sum (d,), so that the
        # spread is that of every rank's rows about their common mean, as one process's batch has it
        code, counts, numbers = None, x.new_zeros(width), x.new_zeros(3 + x.shape[1], dtype=torch.float64)
        if n:  # the single-process step's forward and loss (a sparse code stays sparse), on this rank's rows
            x, code, x_hat = sae._forward(x, w)
            loss = sae._recon_loss(x, code, x_hat, w) + sae._penalty(x, x_hat, code, w)
            loss.backward()
            counts = _fired(code, x, width)  # (width,)
            rows = x.double()
            numbers = torch.cat([torch.stack([(x - x_hat.detach()).pow(2).sum().double(), rows.pow(2).sum(),
                                              loss.detach().double() * n]), rows.sum(0)])
        total, fired, (sse, sq_norm, loss_sum, *sums) = ddp.all_reduce_step(comm, list(sae.params.values()), counts,
                                                                          numbers, n)
        var = sq_norm - sum(s * s for s in sums) / total  # sum ||x - mean||^2 over every rank's rows
        with torch.no_grad():
            self._apply_gradients()
            self.tracker.observe(fired, total)
            values = torch.tensor([sse / max(var, 1e-12), float(fired.sum()) / total,  # the 4 StepStats fields
                                   self.tracker.dead().float().mean().item(), loss_sum / total], dtype=torch.float64)
            self.running.observe(values, total)
            if code is not None:
                sae._after_step(code)
            ddp.sync_buffers(comm, list(sae.buffer_dict.values()), n)

    def _start(self, x: Tensor) -> None:
        self.sae._start(x)
        self.optimizer = self._adam()

    def _adam(self) -> torch.optim.Adam:
        config = self.sae.config
        params = list(self.sae.params.values())
        # one fused kernel per step instead of a dozen passes over each tensor (5x on CPU; the same
        # update up to float rounding, deterministic, so resume stays bit-identical)
        # (a state loaded from a checkpoint keeps its own flag: an older one resumes unfused, as it ran)
        fused = all(p.device.type in ("cpu", "cuda") for p in params)
        return torch.optim.Adam(params, lr=config.learning_rate(), betas=config.betas, fused=fused)

    def optimiser(self) -> torch.optim.Adam:
        """The Adam optimiser; NotFittedError before the first step."""
        if self.optimizer is None:
            raise NotFittedError(f"{type(self.sae).__name__} has no optimiser before its first step")
        return self.optimizer

    def _apply_gradients(self) -> None:
        """The Adam step, with the decoder rows' radial gradient removed and the rows renormalised,
        then the variant's own constraints (`_constrain`): on every rank, with rows or without."""
        sae = self.sae
        sae._reduce_gradients()
        W = sae.params.get("W_dec")
        if sae.unit_decoder and W is not None and W.grad is not None:
            g = W.grad  # (width, d)
            g -= (g * W).sum(1, keepdim=True) * W
        optimiser = self.optimiser()
        match_layouts(optimiser)
        optimiser.step()
        if sae.unit_decoder and W is not None:
            W /= W.norm(dim=1, keepdim=True).clamp(min=1e-12)
        sae._constrain()

    def _record(self, x: Tensor, x_hat: Tensor, code: Code, loss: Tensor) -> None:
        counts = _fired(code, x, self.sae.config.width)  # (width,)
        self.tracker.observe(counts.long(), x.shape[0])
        sse = (x - x_hat.detach()).pow(2).sum()
        var = (x - x.mean(0)).pow(2).sum().clamp(min=1e-12)
        values = torch.stack([sse / var, counts.sum() / x.shape[0],  # (4,) StepStats, left on the device
                              self.tracker.dead().float().mean(), loss.detach()])
        self.running.observe(values, x.shape[0])

    # ---- state ------------------------------------------------------------------------
    def state(self) -> TrainerState:
        """A copy of the training state (nothing in it is shared with the live trainer)."""
        # deep copy: Adam's state_dict shares its moment tensors with the live optimiser
        return TrainerState(dataclasses.replace(self.warm),
                            None if self.optimizer is None else copy.deepcopy(self.optimizer.state_dict()),
                            self.generator.get_state(), self.mixer.state_dict(), self.tracker.state_dict(),
                            self.running.state_dict())

    def load_state(self, state: TrainerState) -> None:
        """Restore `state()`, after the module has its parameters (Adam is rebuilt over them)."""
        self.warm = dataclasses.replace(state.warm)
        self.optimizer = None  # (a set rebuilt from its concepts has parameters and no optimiser yet)
        if self.sae.params and state.optimizer is not None:
            self.optimizer = self._adam()
            self.optimizer.load_state_dict(copy.deepcopy(state.optimizer))
        self.generator.set_state(state.generator)
        self.mixer.load_state_dict(state.mixer)
        self.tracker = LatentTracker(self.sae.config.width, self.sae.config.dead_after, self.sae.tensor_device)
        self.tracker.load_state_dict(state.tracker)
        self.running.load_state_dict(state.running)

    # ---- replicas ---------------------------------------------------------------------
    def mark_shared_start(self) -> None:
        """Declare the current state the start of replicas (before handing out its state dict), so
        that a `merge` of replicas that loaded it counts its firing counts and tokens once."""
        self.tracker.mark_shared_start()
        self.running.origin = self.running.tokens

    @torch.no_grad()
    def merge(self, other: SAETrainer) -> None:
        """Absorb a data-parallel replica's training (see `SparseAutoencoder._merge`)."""
        sae, theirs = self.sae, other.sae
        if theirs.config != sae.config:
            raise ValueError(f"replicas need the same config; got {theirs.config} and {sae.config}")
        if theirs.d is None:
            return  # it has seen nothing
        if sae.d is not None and theirs.d != sae.d:
            raise ValueError(f"cannot merge an SAE of width d={theirs.d} into one of width d={sae.d}")
        mine, rows = self.mixer.state_dict()["data"], other.mixer.state_dict()["data"]  # rows: what joins
        if not sae.params and theirs.params:  # this one has not started: take the other's state (and buffer)
            sae.load_state_dict(theirs.state_dict())
            rows = mine
        elif sae.params and theirs.params:
            self._average(other)
        elif sae.params and theirs.scale is None:  # the other still warms up: its raw rows join (this scale),
            pass  # as they would if it merged this one (it takes this state, then adds its own rows)
        elif not sae.params and not theirs.params and sae.scale is None:  # both warming up: pool the sums
            sae.d = theirs.d
            self.warm = WarmUp(self.warm.sum_sq + other.warm.sum_sq, self.warm.rows + other.warm.rows)
            if theirs.scale is not None:
                sae.scale = theirs.scale
            elif self.warm.rows >= sae.config.warmup_tokens:
                self._set_scale()
        elif theirs.scale != sae.scale:
            raise ValueError(f"replicas must share the input width and warm-up scale (start them from one "
                             f"state_dict); got d={sae.d}, scale={sae.scale} and d={theirs.d}, scale={theirs.scale}")
        if rows is not None and len(rows):  # the other's buffered rows join this buffer (this one's are in it)
            self.mixer.add(rows.to(self.mixer.device))

    def _average(self, other: SAETrainer) -> None:
        """Equal-weight average of parameters, buffers and Adam moments; firing counts and trained
        tokens add (a replica that reloads the merged state has both histories, so frequencies stay
        fractions); the step count is the larger one, the same as Adam's, since replicas step in parallel."""
        sae, theirs = self.sae, other.sae
        if type(theirs) is not type(sae):
            raise TypeError(f"can only merge a {type(sae).__name__} with another; got {type(theirs).__name__}")
        if theirs.scale != sae.scale or theirs.d != sae.d:
            raise ValueError(f"replicas must share the input width and warm-up scale (start them from one "
                             f"state_dict); got d={sae.d}, scale={sae.scale} and d={theirs.d}, scale={theirs.scale}")
        for name, p in sae.params.items():
            q = theirs.params[name]
            p.add_(q.to(p.device)).mul_(0.5)
            mine, their = self.optimiser().state[p], other.optimiser().state[q]
            for key in ("exp_avg", "exp_avg_sq"):
                mine[key].add_(their[key].to(p.device)).mul_(0.5)
            mine["step"] = torch.maximum(mine["step"], their["step"].to(mine["step"].device))
        for name, b in sae.buffer_dict.items():
            if b.is_floating_point():
                b.add_(theirs.buffer_dict[name].to(b.device)).mul_(0.5)
        W = sae.params.get("W_dec")
        if sae.unit_decoder and W is not None:
            W /= W.norm(dim=1, keepdim=True).clamp(min=1e-12)
        sae._constrain()  # the mean of two unit rows is shorter
        self.tracker.merge(other.tracker)
        self.running.merge(other.running)


def match_layouts(optimiser: torch.optim.Optimizer) -> None:
    """Give each parameter's gradient and Adam moments the parameter's strides (a copy where they
    differ, as an all-reduced gradient of the transposed W_enc): torch's fused Adam pairs a parameter
    with its gradient and moments by memory order, so a tensor laid out otherwise would update the
    wrong elements."""
    for p in optimiser.param_groups[0]["params"]:
        if p.grad is not None and p.grad.stride() != p.stride():
            p.grad = torch.empty_like(p).copy_(p.grad)
        state = optimiser.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state and state[key].stride() != p.stride():
                state[key] = torch.empty_like(p).copy_(state[key])


def _fired(code: Code, x: Tensor, width: int) -> Tensor:
    """(width,) how many of the rows of `x` `(B, d)` fire each latent of `code`, in x's dtype. A code given
    as its active entries is counted from them alone, with no pass over `(B, width)`; a dense one by a
    matrix-vector product (on CPU, reductions of a (B, width) bool tensor along either dimension are
    several times slower)."""
    if code.active is not None:
        fired_at = code.active.values.detach().ne(0).to(x.dtype)  # (M,)
        return x.new_zeros(width).index_add_(0, code.active.latents, fired_at)
    return x.new_ones(x.shape[0]) @ code.z.detach().ne(0).to(x.dtype)
