"""SparseAutoencoder: the streaming training loop every SAE variant shares.

    sae = TopKSAE(width=4608, k=32, seed=0)     # a variant; d is read from the first batch
    for x in stream:                            # x: (N, d) float32 raw activations
        sae.update(x)
    sae.flush()                                 # end of stream: train on what is buffered
    sae.stats()                                 # FVU, L0, dead fraction (last step, running mean)
    cs = sae.concept_set()                      # directions = decoder rows, in raw units

Training happens in a normalised space: x_n = s x with one scalar s chosen over the first
`warmup_tokens` so that E||x_n||^2 = d. On export the scale is folded into the weights so that
`encode`, `decode` and the ConceptSet work on raw activations, with latents in raw units and
unit-norm decoder rows (for the linear variants this needs the activation to be positively
homogeneous, which ReLU, TopK and JumpReLU gates are):
    z_raw = z_n / s,  W_enc, W_dec unchanged,  b_enc, b_dec, threshold divided by s.

A variant overrides the encoding (`_activate`) and its loss term (`_penalty`); the buffer,
optimiser, decoder constraint, statistics and checkpointing live here.

An SAE is an `nn.Module`: its trainable tensors are parameters and its non-trainable ones
buffers (created at the first step, once d is known), so `named_parameters()`, `.to()`,
`.cuda()`, `state_dict()` / `load_state_dict()` (the rest of the training state rides along as
torch's `_extra_state`), nesting in another module and DDP work as they do for any module;
`sae(x)` is the differentiable raw-space reconstruction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from conceptlens._checks import check_int
from conceptlens.concepts.base import ExtractorBase, NotFittedError, map_tensors
from conceptlens.concepts.buffer import MixingBuffer
from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.concepts.sae import ddp
from conceptlens.concepts.sae.active import Active
from conceptlens.concepts.sae.buffers import Buffers
from conceptlens.concepts.sae.config import SAEConfig, build_config
from conceptlens.concepts.sae.persist import EXTRA, extra_state, load_training_state, merge_replicas, module_layout
from conceptlens.concepts.sae.stats import LatentTracker, RunningStats, SAEStats, StepStats, geometric_median


class Code(NamedTuple):
    """An encoding: the latents and the pre-activations they were gated from."""

    z: Tensor
    """(N, width) latent activations."""
    pre: Tensor
    """(N, width) pre-activations (for SpaDE: the scaled negative squared distances)."""
    active: Active | None = None
    """A sparse training code's nonzeros row by row (TopK variants on CPU): decoded and counted
    without a pass over `z`."""


class SparseAutoencoder(ExtractorBase, nn.Module):
    """Base of the SAE variants: implements the Extractor protocol around `_activate`.

    Subclasses set `Config` and `method`, and override `_activate(pre, w, train)` and, if
    they have one, `_penalty(x, x_hat, code, w)`. The decoder rows are kept at unit norm:
    the gradient component along each row is removed before the Adam step and the rows are
    renormalised after it.
    """

    Config: ClassVar[type[SAEConfig]] = SAEConfig
    method: ClassVar[str] = "sae"
    distributed: ClassVar[str | None] = "step"
    unit_decoder: ClassVar[bool] = True
    folded_by_scale: ClassVar[tuple[str, ...]] = ("b_enc", "b_dec", "threshold")

    def __init__(self, config: SAEConfig | None = None, /, *, seed: int = 0,
                 device: str | torch.device | None = None, **kwargs: Any) -> None:
        nn.Module.__init__(self)
        self.config = build_config(self.Config, config, kwargs)
        check_int("seed", seed, 0)
        self._set_device(device)
        self.seed = seed
        self.d: int | None = None
        self.scale: float | None = None
        self._gen = torch.Generator().manual_seed(seed)
        self._mixer = MixingBuffer(size=self.config.mixing_size(), seed=seed)
        self._warm = [0.0, 0]  # sum of ||x||^2 (float64 accumulated) and rows, during warm-up
        self._device = self.device or torch.device("cpu")
        self._opt: torch.optim.Adam | None = None
        self._tracker = LatentTracker(self.config.width, self.config.dead_after)
        self._running = RunningStats()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config}, d={self.d}, steps={self._running.steps})"

    # ---- the module's tensors ---------------------------------------------------------
    @property
    def params(self) -> dict[str, Tensor]:
        """The trainable tensors (the module's parameters, in the normalised space), by name."""
        return {k: p for k, p in self._parameters.items() if p is not None}

    @params.setter
    def params(self, values: dict[str, Tensor]) -> None:
        self._parameters.clear()
        for k, v in values.items():
            self.register_parameter(k, v if isinstance(v, nn.Parameter) else nn.Parameter(v))

    @property
    def buffer_dict(self) -> Buffers:
        """The non-trainable tensors a variant keeps (the module's buffers), as a mutable dict."""
        return Buffers(self)

    @buffer_dict.setter
    def buffer_dict(self, values: dict[str, Tensor]) -> None:
        self._buffers.clear()
        for k, v in values.items():
            self.register_buffer(k, v)

    def forward(self, x: Tensor) -> Tensor:
        """The reconstruction `(N, d)` of raw activations `(N, d)`, differentiable in the parameters."""
        if not self.params or self.scale is None:
            raise self._not_fitted()
        w = self._fold(self._weights(), self.scale)
        return self._decode(self._encode(x.to(self._device).float(), w, train=False).z, w, train=False)

    # ---- streaming -------------------------------------------------------------------
    def update(self, x: Tensor) -> None:
        """Buffer the rows of `x` `(N, d)`; take one Adam step per `batch_size` mixed rows."""
        x = self._check_input(x)
        if self.scale is None:
            self._warm_up(x)
        self._mixer.add(x)
        if self.scale is None:
            return
        if self.comm is not None:  # every rank takes as many steps as the rank with the most rows
            size = self.config.batch_size
            for _ in range(self.comm.max_int(self._mixer.ready(size))):
                batch = self._mixer.take(size)
                self._step(batch if batch is not None else x[:0])
            return
        while (batch := self._mixer.take(self.config.batch_size)) is not None:
            self._step(batch)

    def flush(self) -> None:
        """Train on everything still buffered (the last batch may be short); call at stream end."""
        if self.scale is None and self._warm[1] > 0:
            self._set_scale()
        rest = self._mixer.drain() if self.scale is not None else None
        batches = [] if rest is None else list(rest.split(self.config.batch_size))
        n = len(batches) if self.comm is None or self.d is None else self.comm.max_int(len(batches))
        for i in range(n):
            self._step(batches[i] if i < len(batches) else torch.zeros(0, self.d))

    def _check_input(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) or x.ndim != 2 or not x.is_floating_point():
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{type(self).__name__}.update expects a float tensor (N, d); got {got}")
        device = self.device or x.device
        if self.d is None:
            self.d, self._device = x.shape[1], device
            self._tracker = LatentTracker(self.config.width, self.config.dead_after, device)
        elif not self.params and self._device != device:  # resumed before the first step
            self._device = device
            state = self._tracker.state_dict()
            self._tracker = LatentTracker(self.config.width, self.config.dead_after, device)
            self._tracker.load_state_dict(state)
        elif x.shape[1] != self.d:
            raise ValueError(f"{type(self).__name__} was fitted on width d={self.d}; got width {x.shape[1]}")
        return x.to(self.compute_dtype)  # buffered in the compute dtype

    def _warm_up(self, x: Tensor) -> None:
        rows = x[: self.config.warmup_tokens - self._warm[1]]
        if self.comm is not None:  # the warm-up sums of every rank: one scale for all
            total = self.comm.sum_(torch.stack([rows.double().pow(2).sum().cpu(), torch.tensor(rows.shape[0] * 1.0,
                                                                                                 dtype=torch.float64)]))
            self._warm[0] += float(total[0])
            self._warm[1] += int(total[1])
        else:
            self._warm[0] += float(rows.double().pow(2).sum())
            self._warm[1] += rows.shape[0]
        if self._warm[1] >= self.config.warmup_tokens:
            self._set_scale()

    def _set_scale(self) -> None:
        mean_sq = self._warm[0] / self._warm[1]
        if not mean_sq > 0:
            raise ValueError(f"the first {self._warm[1]} rows are all zero; cannot normalise their scale")
        self.scale = (self.d / mean_sq) ** 0.5

    # ---- one optimiser step ---------------------------------------------------------
    def _step(self, batch: Tensor) -> None:
        x = self._normalise(batch.to(self._device).float())  # (B, d), float32 (the loss's target)
        if self.comm is not None:
            ddp.step(self, x)
            return
        if self._opt is None:
            self._start(x)
        w = self._compute_weights()
        x, code, x_hat = self._forward(x, w)  # target (B, d), code, x_hat (B, d)
        recon = self._recon_loss(x, code.z, x_hat, w)
        loss = recon + self._penalty(x, x_hat, code, w)
        self._optimiser().zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            self._apply_gradients()
            self._record(x, x_hat, code, loss)
            self._after_step(code)

    def _forward(self, x: Tensor, w: dict[str, Tensor]) -> tuple[Tensor, Code, Tensor]:
        """The target, the code and its reconstruction for a normalised batch (a transcoder
        reads part of each row and reconstructs the rest)."""
        code = self._encode(x.to(self.compute_dtype), w, train=True)
        return x, code, self._decode(code.z, w, train=True)

    def _normalise(self, x: Tensor) -> Tensor:
        """Raw rows `(B, d)` -> the training space (x times the warm-up scale; SpaDE standardises)."""
        return x * self.scale

    def _apply_gradients(self) -> None:
        """The Adam step, with the decoder rows' radial gradient removed and the rows renormalised."""
        if self.unit_decoder:
            W, g = self.params["W_dec"], self.params["W_dec"].grad  # (width, d)
            g -= (g * W).sum(1, keepdim=True) * W
        self._optimiser().step()
        if self.unit_decoder:
            W /= W.norm(dim=1, keepdim=True).clamp(min=1e-12)

    def _optimiser(self) -> torch.optim.Adam:
        """The Adam optimiser, made by `_start` on the first step (or restored from a state)."""
        if self._opt is None:
            raise NotFittedError(f"{type(self).__name__} has no optimiser before its first step")
        return self._opt

    def _start(self, x: Tensor) -> None:
        if not self.params:  # (a rebuilt SAE already has its parameters)
            self.params = {k: v.to(self._device).requires_grad_(True) for k, v in self._init_params(x).items()}
        self._opt = torch.optim.Adam(list(self.params.values()), lr=self.config.learning_rate(),
                                     betas=self.config.betas)

    def _record(self, x: Tensor, x_hat: Tensor, code: Code, loss: Tensor) -> None:
        # per-latent firing counts as a matrix-vector product: on CPU, reductions of a
        # (B, width) bool tensor along either dimension are several times slower
        if code.active is not None:  # count the active latents only: no pass over (B, width)
            fired_at = code.active.values.detach().ne(0).to(x.dtype)  # (M,)
            counts = x.new_zeros(self.config.width).index_add_(0, code.active.latents, fired_at)
        else:
            fired = code.z.detach().ne(0).float()  # (B, width)
            counts = x.new_ones(x.shape[0]) @ fired  # (width,)
        self._tracker.observe(counts.long(), x.shape[0])
        sse = (x - x_hat.detach()).pow(2).sum()
        var = (x - x.mean(0)).pow(2).sum().clamp(min=1e-12)
        values = torch.stack([sse / var, counts.sum() / x.shape[0],  # (4,) StepStats, left on the device
                              self._tracker.dead().float().mean(), loss.detach()])
        self._running.observe(values, x.shape[0])

    def stats(self) -> SAEStats:
        """Steps, tokens, the last step's FVU / L0 / dead fraction / loss, and their running means."""
        return self._running.summary()

    # ---- what variants override -------------------------------------------------------
    def _init_params(self, x: Tensor) -> dict[str, Tensor]:
        """Initial parameters from the first normalised batch `x` `(B, d)`: tied W_enc = W_dec^T."""
        width, d = self.config.width, x.shape[1]
        W_dec = self._init_rows(width, d)  # (width, d); a sharded SAE draws only its rows
        W_dec /= W_dec.norm(dim=1, keepdim=True)
        init = self.config.b_dec_init
        b_dec = (geometric_median(x) if init == "geometric_median" else x.mean(0) if init == "mean"
                 else torch.zeros(d))
        return {"W_enc": W_dec.T.clone(), "b_enc": torch.zeros(len(W_dec)), "W_dec": W_dec, "b_dec": b_dec.cpu()}

    def _init_rows(self, width: int, d: int) -> Tensor:
        """The initial decoder rows `(width, d)`, before normalisation (standard normal)."""
        return torch.randn(width, d, generator=self._gen)

    def _weights(self) -> dict[str, Tensor]:
        """The weights the encoding uses, derived from `params` and `buffers` (differentiable)."""
        return {**self.params, **self.buffer_dict}

    def _compute_weights(self) -> dict[str, Tensor]:
        """`_weights()` cast to the compute dtype (differentiable casts of the float32 masters,
        so the gradients reach the masters in float32); the weights themselves in float32."""
        w, dtype = self._weights(), self.compute_dtype
        if dtype == torch.float32:
            return w
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in w.items()}

    def _encode(self, x: Tensor, w: dict[str, Tensor], train: bool) -> Code:
        pre = (x - w["b_dec"]) @ w["W_enc"] + w["b_enc"]  # (N, width)
        return Code(self._activate(pre, w, train), pre)

    def _activate(self, pre: Tensor, w: dict[str, Tensor], train: bool) -> Tensor:
        """The variant's gate: pre-activations `(N, width)` -> latents `(N, width)`."""
        raise NotImplementedError(f"{type(self).__name__} must define _activate")

    def _decode(self, z: Tensor, w: dict[str, Tensor], train: bool = False) -> Tensor:
        return z @ w["W_dec"] + w["b_dec"]  # (N, d)

    def _recon_loss(self, x: Tensor, z: Tensor, x_hat: Tensor, w: dict[str, Tensor]) -> Tensor:
        """Mean over tokens of ||x - x_hat||^2."""
        return (x - x_hat).pow(2).sum(-1).mean()

    def _penalty(self, x: Tensor, x_hat: Tensor, code: Code, w: dict[str, Tensor]) -> Tensor:
        """The variant's extra loss term (sparsity, auxiliary); none by default."""
        return x.new_zeros(())

    def _after_step(self, code: Code) -> None:
        """Update non-trainable state from the step's code; nothing by default."""

    def _fold(self, w: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
        """Raw-space weights from normalised ones (see the module docstring)."""
        keep = ("W_enc", "W_dec", *self.folded_by_scale)
        return {k: v / scale if k in self.folded_by_scale else v for k, v in w.items() if k in keep}

    # ---- inference on raw activations -------------------------------------------------
    def _raw(self) -> dict[str, Tensor]:
        if not self.params:
            raise self._not_fitted()
        with torch.no_grad():
            return {k: v.detach() for k, v in self._fold(self._weights(), self.scale).items()}

    def _not_fitted(self) -> NotFittedError:
        seen = self._warm[1] + self._tracker.tokens
        return NotFittedError(f"{type(self).__name__} has not taken a step yet ({seen} tokens seen, warm-up "
                              f"{self.config.warmup_tokens}, batch {self.config.batch_size}); call update() or flush()")

    @torch.no_grad()
    def encode(self, x: Tensor) -> Tensor:
        """Raw activations `(N, d)` -> latents `(N, width)` in raw units."""
        return self._encode(x.to(self._device).float(), self._raw(), train=False).z

    @torch.no_grad()
    def decode(self, z: Tensor) -> Tensor:
        """Latents `(N, width)` -> reconstructed raw activations `(N, d)`."""
        return self._decode(z.to(self._device).float(), self._raw(), train=False)

    def reconstruct(self, x: Tensor) -> Tensor:
        """`decode(encode(x))`, `(N, d)`."""
        return self.decode(self.encode(x))

    def concept_set(self) -> ConceptSet:
        """Decoder rows as directions; the raw-space encoder and firing frequencies come along."""
        raw = {k: v.cpu() for k, v in self._raw().items()}
        directions = raw.pop("W_dec")
        config = {**self.config.to_json(), "seed": self.seed, "input_scale": self.scale,
                  "steps": self._running.steps, "tokens": self._running.tokens}
        return ConceptSet(directions, method=self.method, config=config, encoder=raw,
                          stats={"firing_frequency": self._tracker.frequency().cpu()})

    # ---- checkpoints and replicas ------------------------------------------------------
    # state_dict() is nn.Module's: parameters and buffers by name, and under "_extra_state" the
    # optimiser, buffered rows, RNG and statistics: enough to resume bit for bit.
    def get_extra_state(self) -> dict[str, Any]:
        return extra_state(self)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return nn.Module.state_dict(self, *args, **kwargs)

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """`sae.to(device)` as every extractor (later inputs are placed there too); any other
        arguments as nn.Module's."""
        if len(args) == 1 and not kwargs and isinstance(args[0], (str, torch.device)):
            return ExtractorBase.to(self, args[0])
        return nn.Module.to(self, *args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Restore a `state_dict()` (also one written before the SAEs were modules); creates the
        parameters and buffers it holds. `strict` and `assign` are accepted for nn.Module's callers."""
        state = module_layout(state_dict)
        self.check_state(state[EXTRA])
        load_training_state(self, self._placed(state))
        return nn.modules.module._IncompatibleKeys([], [])

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        """As a submodule of another module: this SAE's entries of the parent's state dict."""
        self.load_state_dict({k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)})

    def _apply(self, fn: Any, recurse: bool = True) -> SparseAutoencoder:
        """`.cuda()`, `.cpu()`, `.to(...)` through nn.Module: every tensor of the training state
        (Adam's moments and the buffered rows included) goes where the parameters go."""
        self.load_state_dict(map_tensors(self.state_dict(), fn))
        return self

    @classmethod
    def from_config(cls, config: dict[str, Any], seed: int = 0) -> SparseAutoencoder:
        names = {f.name for f in dataclasses.fields(cls.Config)}
        return cls(seed=seed, **{k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k in names})

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SparseAutoencoder:
        extra = module_layout(state)[EXTRA]
        if "config" not in extra:
            raise ValueError(f"not a {cls.__name__} state: expected a dict with a 'config' entry")
        obj = cls.from_config(extra["config"], seed=extra.get("seed", 0))
        obj.load_state_dict(state)
        return obj

    def _merge(self, other: SparseAutoencoder) -> None:
        """Combine with a data-parallel replica (local SGD); `merge` also takes its state dict.

        SAEs have no sufficient statistics to add up. Replicas that started from one state
        (load the same `state_dict` after warm-up, so they share the input scale and the
        initialisation) and trained on different shards are averaged with equal weights
        (parameters, Adam moments); firing records and token counts add, the step count is
        the larger one, and the other's buffered rows join this buffer (trained on at the
        next `update` or `flush`). A replica that has not started yet takes the other's
        state; two still warming up pool their warm-up sums. For training across processes
        the fit all-reduces gradients every step instead (see conceptlens/distributed.py).
        """
        merge_replicas(self, other)
