"""SparseAutoencoder: the model every SAE variant shares, an `nn.Module` trained by its `SAETrainer`.

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

A variant overrides `_activate` and `_penalty`. The module holds the model (parameters and
buffers, made at the first step once d is known; d, scale, the math) and the Extractor protocol;
`sae.trainer` (trainer.py: mixing buffer, warm-up, Adam, distributed steps, statistics) does
`update`, `flush`, `stats` and `merge`. `.to()`, `state_dict()` (the trainer's state rides along as
`_extra_state`, an `SAEState`), DDP and `torch.compile` work; `sae(x)` reconstructs in raw space.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from conceptlens._checks import check_int
from conceptlens.concepts.base import ExtractorBase, NotFittedError
from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.concepts.sae.active import active_decode
from conceptlens.concepts.sae.buffers import TensorModule
from conceptlens.concepts.sae.config import SAEConfig, build_config
from conceptlens.concepts.sae.persist import EXTRA, SAEState, WarmUp, module_layout
from conceptlens.concepts.sae.stats import SAEStats, geometric_median
from conceptlens.concepts.sae.trainable import Code
from conceptlens.concepts.sae.trainer import SAETrainer

__all__ = ["Code", "SparseAutoencoder"]


class SparseAutoencoder(ExtractorBase, TensorModule):
    """Base of the SAE variants: the model and the Extractor protocol around `_activate`.

    Subclasses set `Config` and `method`, and override `_activate(pre, w, train)` and, if
    they have one, `_penalty(x, x_hat, code, w)`. The decoder rows are kept at unit norm
    (`unit_decoder`): the trainer removes the gradient component along each row before the
    Adam step and renormalises the rows after it.
    """

    Config: ClassVar[type[SAEConfig]] = SAEConfig
    method: ClassVar[str] = "sae"
    distributed: ClassVar[str | None] = "step"
    unit_decoder: ClassVar[bool] = True
    folded_by_scale: ClassVar[tuple[str, ...]] = ("b_enc", "b_dec", "threshold")
    own_state: ClassVar[tuple[str, ...]] = ()
    """A variant's attributes saved as they are with its state (a transcoder's input width)."""

    def __init__(self, config: SAEConfig | None = None, /, *, seed: int = 0,
                 device: str | torch.device | None = None, **kwargs: Any) -> None:
        nn.Module.__init__(self)
        self.config = build_config(self.Config, config, kwargs)
        check_int("seed", seed, 0)
        self._set_device(device)
        self.seed = seed
        self.d: int | None = None
        self.scale: float | None = None
        self.tensor_device = self.device or torch.device("cpu")
        self.trainer = SAETrainer(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config}, d={self.d}, steps={self.trainer.running.steps})"

    def forward(self, x: Tensor) -> Tensor:
        """The reconstruction `(N, d)` of raw activations `(N, d)`, differentiable in the parameters."""
        if not self.params or self.scale is None:
            raise self._not_fitted()
        w = self._fold(self._weights(), self.scale)
        return self._decode(self._encode(x.to(self.tensor_device).float(), w, train=False).z, w, train=False)

    # ---- streaming: the trainer's ------------------------------------------------------
    def update(self, x: Tensor) -> None:
        """Buffer the rows of `x` `(N, d)`; one Adam step per `batch_size` mixed rows (`SAETrainer.update`)."""
        self.trainer.update(x)

    def flush(self) -> None:
        """Train on everything still buffered (the last batch may be short); call at stream end."""
        self.trainer.flush()

    def stats(self) -> SAEStats:
        """Steps, tokens, the last step's FVU / L0 / dead fraction / loss, and their running means."""
        return self.trainer.stats()

    def check_input(self, x: Tensor) -> Tensor:
        """A training batch `(N, d)` in the compute dtype; the first fixes d (and, without `device`,
        where the tensors live)."""
        if not isinstance(x, Tensor) or x.ndim != 2 or not x.is_floating_point():
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{type(self).__name__}.update expects a float tensor (N, d); got {got}")
        device = self.device or x.device
        if self.d is None:
            self.d, self.tensor_device = x.shape[1], device
        elif not self.params and self.tensor_device != device:  # resumed before the first step
            self.tensor_device = device
        elif x.shape[1] != self.d:
            raise ValueError(f"{type(self).__name__} was fitted on width d={self.d}; got width {x.shape[1]}")
        return x.to(self.compute_dtype)  # buffered in the compute dtype

    # ---- what the trainer calls and variants override -----------------------------------
    def _warm_up(self, rows: Tensor) -> None:
        """A variant's own statistics of the warm-up rows `(n, d)`; none by default."""

    def _set_scale(self, sum_sq: float, rows: int) -> None:
        """The input scale s with E||s x||^2 = d, from the warm-up's sum of ||x||^2 over `rows` rows."""
        mean_sq = sum_sq / rows
        if self.d is None:
            raise self._not_fitted()
        if not mean_sq > 0:
            raise ValueError(f"the first {rows} rows are all zero; cannot normalise their scale")
        self.scale = (self.d / mean_sq) ** 0.5

    def _normalise(self, x: Tensor) -> Tensor:
        """Raw rows `(B, d)` -> the training space (x times the warm-up scale; SpaDE standardises)."""
        if self.scale is None:
            raise self._not_fitted()
        return x * self.scale

    def _start(self, x: Tensor) -> None:
        """Parameters from the first normalised batch `x` `(B, d)` (a rebuilt SAE already has them)."""
        if not self.params:
            self.params = {k: v.to(self.tensor_device).requires_grad_(True) for k, v in self._init_params(x).items()}

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
        return torch.randn(width, d, generator=self.trainer.generator)

    def _forward(self, x: Tensor, w: dict[str, Tensor]) -> tuple[Tensor, Code, Tensor]:
        """The target, the code and its reconstruction for a normalised batch (a transcoder
        reads part of each row and reconstructs the rest). A code given as its active entries
        (`Code.active`: TopK variants and JumpReLU on CPU) is decoded by gathering their decoder
        rows, with no dense `(B, width)` code."""
        code = self._encode(x.to(self.compute_dtype), w, train=True)
        if code.active is None:
            return x, code, self._decode(code.z, w, train=True)
        a = code.active
        return x, code, active_decode(a.latents, a.values, a.offsets, w["W_dec"]) + w["b_dec"]

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

    def _recon_loss(self, x: Tensor, code: Code, x_hat: Tensor, w: dict[str, Tensor]) -> Tensor:
        """Mean over tokens of ||x - x_hat||^2."""
        return (x - x_hat).pow(2).sum(-1).mean()

    def _penalty(self, x: Tensor, x_hat: Tensor, code: Code, w: dict[str, Tensor]) -> Tensor:
        """The variant's extra loss term (sparsity, auxiliary); none by default."""
        return x.new_zeros(())

    def _reduce_gradients(self) -> None:
        """Combine gradients across ranks before Adam (a sharded SAE's); nothing by default."""

    def _counted(self, code: Code) -> Code:
        """The code whose latents the statistics count (a sharded SAE gathers its shards')."""
        return code

    def _after_step(self, code: Code) -> None:
        """Update non-trainable state from the step's code (a rank without rows has none, and does not
        call it); nothing by default."""

    def _constrain(self) -> None:
        """Put the parameters back on the variant's constraint set after every Adam step (on every rank)
        and after a merge; nothing by default (`unit_decoder` rows are the trainer's)."""

    def _fold(self, w: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
        """Raw-space weights from normalised ones (see the module docstring)."""
        keep = ("W_enc", "W_dec", *self.folded_by_scale)
        return {k: v / scale if k in self.folded_by_scale else v for k, v in w.items() if k in keep}

    # ---- inference on raw activations -------------------------------------------------
    def _raw(self) -> dict[str, Tensor]:
        if not self.params or self.scale is None:
            raise self._not_fitted()
        with torch.no_grad():
            return {k: v.detach() for k, v in self._fold(self._weights(), self.scale).items()}

    def _not_fitted(self) -> NotFittedError:
        seen = self.trainer.warm.rows + self.trainer.tracker.tokens
        return NotFittedError(f"{type(self).__name__} has not taken a step yet ({seen} tokens seen, warm-up "
                              f"{self.config.warmup_tokens}, batch {self.config.batch_size}); call update() or flush()")

    @torch.no_grad()
    def encode(self, x: Tensor) -> Tensor:
        """Raw activations `(N, d)` -> latents `(N, width)` in raw units."""
        return self._encode(x.to(self.tensor_device).float(), self._raw(), train=False).z

    @torch.no_grad()
    def decode(self, z: Tensor) -> Tensor:
        """Latents `(N, width)` -> reconstructed raw activations `(N, d)`."""
        return self._decode(z.to(self.tensor_device).float(), self._raw(), train=False)

    def reconstruct(self, x: Tensor) -> Tensor:
        """`decode(encode(x))`, `(N, d)`."""
        return self.decode(self.encode(x))

    def concept_set(self) -> ConceptSet:
        """Decoder rows as directions; the raw-space encoder and firing frequencies come along."""
        raw = {k: v.cpu() for k, v in self._raw().items()}
        directions = raw.pop("W_dec")
        running = self.trainer.running
        config = {**self.config.to_json(), "seed": self.seed, "input_scale": self.scale,
                  "steps": running.steps, "tokens": running.tokens}
        return ConceptSet(directions, method=self.method, config=config, encoder=raw,
                          stats={"firing_frequency": self.trainer.tracker.frequency().cpu()})

    def adopt_raw(self, params: dict[str, Tensor], buffers: dict[str, Tensor], d: int) -> None:
        """Take raw-space weights (a ConceptSet's): scale 1, no optimiser state (`update` starts Adam)."""
        self.params = {k: v.float().clone().requires_grad_(True) for k, v in params.items()}
        self.buffer_dict = buffers
        self.d, self.scale = d, 1.0
        self.trainer.warm = WarmUp(float(d), 1)  # the warm-up that gives scale 1

    # ---- checkpoints and replicas: nn.Module's state_dict(), an SAEState as its extra state ----
    def get_extra_state(self) -> dict[str, Any]:
        return self.extra_state().to_dict()

    def extra_state(self) -> SAEState:
        """What the state dict holds beside the tensors (a copy; nothing in it is shared)."""
        return SAEState(type(self).__name__, self.config.to_json(), self.seed, self.d, self.scale,
                        list(self.params), self.trainer.state(), {k: getattr(self, k) for k in self.own_state})

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
        state = self._placed(module_layout(state_dict))
        saved = SAEState.from_dict(state[EXTRA], self.own_state)
        if saved.cls != type(self).__name__:
            raise ValueError(f"state is for a {saved.cls!r}; this is a {type(self).__name__!r}")
        self.check_state(state[EXTRA])
        self.seed, self.d, self.scale = saved.seed, saved.d, saved.scale
        for key, value in saved.own.items():
            setattr(self, key, value)
        self.params = {k: state[k].clone().requires_grad_(True) for k in saved.parameters}
        self.buffer_dict = {k: v.clone() for k, v in state.items() if k != EXTRA and k not in saved.parameters}
        if self.params:
            self.tensor_device = next(iter(self.params.values())).device
        self.trainer.load_state(saved.trainer)
        return nn.modules.module._IncompatibleKeys([], [])

    @classmethod
    def from_config(cls, config: dict[str, Any], seed: int = 0) -> SparseAutoencoder:
        names = {f.name for f in dataclasses.fields(cls.Config)}
        kwargs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k in names}
        return cls(seed=seed, **kwargs)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SparseAutoencoder:
        extra = module_layout(state)[EXTRA]
        if "config" not in extra:
            raise ValueError(f"not a {cls.__name__} state: expected a dict with a 'config' entry")
        obj = cls.from_config(extra["config"], seed=extra.get("seed", 0))
        obj.load_state_dict(state)
        return obj

    def _merge(self, other: SparseAutoencoder) -> None:
        """Combine with a data-parallel replica (local SGD; `SAETrainer.merge`); `merge` also takes
        its state dict. Replicas of one state marked by `mark_shared_start` count its history once."""
        self.trainer.merge(other.trainer)

    def mark_shared_start(self) -> None:
        """Declare the current state the start of replicas: call it before handing out the state dict
        (each round of local SGD: on the merged state before it is handed out again), so that merging
        the replicas that loaded it counts the firing counts and tokens it already holds once."""
        self.trainer.mark_shared_start()
