"""What a streaming trainer needs of an SAE module: the seam between `SAETrainer` and the model.

    class MySAE(SparseAutoencoder): ...   # implements Trainable: the model's math and its own state
    SAETrainer(MySAE(width=64)).update(x) # the trainer owns the buffer, Adam, warm-up and statistics

The module owns its tensors (parameters, buffers), its input width `d` and scale and the math
(`_encode`, `_decode`, the losses); the trainer owns everything that exists only while training.
A variant overrides the module's hooks below; the trainer calls them and reads nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

from conceptlens.concepts.sae.active import Active
from conceptlens.concepts.sae.config import SAEConfig


class Code:
    """An encoding: the latents and the pre-activations they were gated from.

    `pre` `(N, width)`: the pre-activations (for SpaDE: the scaled negative squared distances);
    `active`: a sparse training code's entries row by row (TopK variants and JumpReLU on CPU), which the step
    decodes, counts and takes its losses from without a pass over `z`.
    """

    __slots__ = ("_z", "pre", "active")

    def __init__(self, z: Tensor | None, pre: Tensor, active: Active | None = None) -> None:
        if z is None and active is None:
            raise ValueError("a Code needs its latents z, its active latents, or both")
        self._z, self.pre, self.active = z, pre, active

    @property
    def z(self) -> Tensor:
        """(N, width) latent activations; a code given only its active latents builds them on the
        first read (differentiable in the active values), so a step that never reads them skips
        the dense fill."""
        if self._z is None:
            if self.active is None:  # (the constructor needs one of them)
                raise ValueError("a Code needs its latents z or its active latents")
            self._z = self.active.dense(self.pre)
        return self._z


class Trainable(Protocol):
    """An SAE module as its trainer sees it (`SparseAutoencoder` implements it)."""

    config: SAEConfig
    seed: int
    d: int | None
    """Input width, fixed by the first batch."""
    scale: float | None
    """The input scale, set when the warm-up ends."""
    comm: Any
    """A `conceptlens.distributed.Comm` when each rank is fed its own rows, else None."""
    tensor_device: torch.device
    """Where the module's tensors live (and training rows go)."""
    unit_decoder: ClassVar[bool]
    """Whether the decoder rows are kept at unit norm."""

    @property
    def compute_dtype(self) -> torch.dtype: ...

    @property
    def params(self) -> dict[str, Tensor]: ...

    @property
    def buffer_dict(self) -> MutableMapping[str, Tensor]: ...

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> Any: ...

    def check_input(self, x: Tensor) -> Tensor:
        """A training batch `(N, d)` checked against the module (fixing d and the device at the first)."""

    def _warm_up(self, rows: Tensor) -> None:
        """A variant's own statistics of the warm-up rows `(n, d)`."""

    def _set_scale(self, sum_sq: float, rows: int) -> None:
        """End the warm-up: the scale from the sum of squared norms of its rows."""

    def _normalise(self, x: Tensor) -> Tensor:
        """Raw rows `(B, d)` -> the training space."""

    def _start(self, x: Tensor) -> None:
        """Create the parameters from the first normalised batch (unless rebuilt with some)."""

    def _compute_weights(self) -> dict[str, Tensor]: ...

    def _forward(self, x: Tensor, w: dict[str, Tensor]) -> tuple[Tensor, Code, Tensor]:
        """(target, code, reconstruction) of a normalised batch."""

    def _encode(self, x: Tensor, w: dict[str, Tensor], train: bool) -> Code: ...

    def _decode(self, z: Tensor, w: dict[str, Tensor], train: bool = False) -> Tensor: ...

    def _recon_loss(self, x: Tensor, code: Code, x_hat: Tensor, w: dict[str, Tensor]) -> Tensor: ...

    def _penalty(self, x: Tensor, x_hat: Tensor, code: Code, w: dict[str, Tensor]) -> Tensor: ...

    def _reduce_gradients(self) -> None:
        """Combine gradients across the ranks that share a step (a sharded SAE), before Adam."""

    def _counted(self, code: Code) -> Code:
        """The code whose latents the statistics count."""

    def _after_step(self, code: Code) -> None:
        """Update non-trainable state from the step's code."""

    def _constrain(self) -> None:
        """Put the parameters back on the variant's constraint set after an Adam step or a merge."""
