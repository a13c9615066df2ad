"""The configuration, result and state types of `CLVQTranscoder` (clvq.py).

    CLVQConfig(n_codes=512, decoder="mlp", dtype="bfloat16")   # validated on construction
    tc.stats()                                                 # a CLVQStats
    tc.parts                                                   # a TranscoderParts, once widths are known
    tc.state()                                                 # a CLVQState (checkpoints, merges)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn

from conceptlens._checks import check_bool, check_choice, check_float, check_int
from conceptlens.concepts.base import check_dtype
from conceptlens.concepts.clvq_modules import MLPDecoder, ResidualEncoder, SequenceDecoder
from conceptlens.concepts.vq_config import VQConfig, VQState

DecoderKind = Literal["mlp", "transformer"]
DECODERS = ("mlp", "transformer")


@dataclass
class CLVQConfig:
    """Hyper-parameters of a `CLVQTranscoder`."""

    n_codes: int
    """Number of codes K."""
    hidden: int = 1024
    """Hidden width of the MLP decoder / model width of the transformer decoder."""
    decoder: DecoderKind = "mlp"
    """"mlp": per token. "transformer": attends over each sequence's codes (needs sequence_ids)."""
    commitment: float = 0.1
    """Weight of MSE(z_e, sg(q)), which keeps the encoder near its codes."""
    lr: float = 1e-3
    """Adam learning rate of the encoder and decoder."""
    batch_size: int | None = 1024
    """Rows per optimiser (and EMA) step; None = one step per call."""
    buffer_size: int | None = None
    """Rows the mixing buffer (MLP decoder) holds before drawing a batch; None = 4 * batch_size."""
    layers: int = 2
    """Transformer decoder layers."""
    heads: int = 4
    """Attention heads of the transformer decoder (must divide hidden)."""
    causal: bool = True
    """The transformer decoder sees only earlier tokens of a sequence (as in a causal LM)."""
    codebook: dict[str, Any] = field(default_factory=dict)
    """Options of the inner `VQCodebook` (decay, eps, top_k, temperature, init, init_size,
    reseed_after, reseed_threshold)."""
    seed: int = 0
    """Seed of the parameter initialisation and of the codebook's generator."""
    dtype: str = "float32"
    """Compute dtype ("float32" or "bfloat16"): encoder and decoder run under `torch.autocast`
    in it (float32 master parameters, gradients and Adam moments; the losses in float32), and
    the codebook computes its distances in it (its EMA statistics stay float32)."""

    def __post_init__(self) -> None:
        self.dtype = check_dtype("dtype", self.dtype)
        check_choice("decoder", self.decoder, DECODERS)
        for name in ("n_codes", "hidden", "layers", "heads"):
            check_int(name, getattr(self, name))
        for name in ("batch_size", "buffer_size"):
            check_int(name, getattr(self, name), optional=True)
        if self.decoder == "transformer" and self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be divisible by heads={self.heads}")
        check_float("commitment", self.commitment)
        check_float("lr", self.lr, strict=True)
        check_bool("causal", self.causal)
        check_int("seed", self.seed, 0)
        if not isinstance(self.codebook, dict):
            raise ValueError(f"codebook must be a dict of VQCodebook options; got {self.codebook!r}")
        allowed = set(VQConfig.__dataclass_fields__) - {"n_codes", "batch_size", "seed", "dtype"}  # dtype: ours
        if set(self.codebook) - allowed:
            raise ValueError(f"unknown codebook options {sorted(set(self.codebook) - allowed)}; "
                             f"valid: {sorted(allowed)}")


class CLVQStats(NamedTuple):
    """Fit-report numbers of a transcoder (EMA over recent steps)."""

    fvu: float
    """FVU of the target by the training reconstructions (sampled codes, before each step)."""
    usage: float
    perplexity: float
    mix: float
    """The encoder's residual mix a = 0.5 sigmoid(alpha)."""
    steps: int
    tokens: int


@dataclass
class TranscoderParts:
    """What a `CLVQTranscoder` builds on its first update, once the widths are known."""

    dims: tuple[int, int]           # (d_src, d_tgt)
    encoder: ResidualEncoder
    decoder: nn.Module
    optimizer: torch.optim.Adam
    pending: list[Tensor]           # rows not yet stepped on: src (M, d_src), tgt (M, d_tgt), ids (M,)
    fvu: Tensor                     # (d_tgt + 3,) float64 EMA of fvu_sums
    scales: dict[str, Tensor] = field(default_factory=dict)   # decoder standardisation, from init

    @classmethod
    def build(cls, cfg: CLVQConfig, dims: tuple[int, int], device: torch.device) -> TranscoderParts:
        """Fresh modules (seeded by `cfg.seed`, the global RNG untouched), their Adam and empty rows."""
        d_src, d_tgt = dims
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            encoder = ResidualEncoder(d_src)
            decoder = (MLPDecoder(d_src, cfg.hidden, d_tgt) if cfg.decoder == "mlp" else
                       SequenceDecoder(d_src, cfg.hidden, d_tgt, cfg.layers, cfg.heads, cfg.causal))
        encoder, decoder = encoder.to(device), decoder.to(device)
        optimizer = torch.optim.Adam([*encoder.parameters(), *decoder.parameters()], lr=cfg.lr)
        pending = [torch.zeros(0, d_src, device=device), torch.zeros(0, d_tgt, device=device),
                   torch.zeros(0, dtype=torch.long, device=device)]
        fvu = torch.zeros(d_tgt + 3, dtype=torch.float64, device=device)
        return cls(dims, encoder, decoder, optimizer, pending, fvu)


@dataclass
class PartsState:
    """`TranscoderParts` as tensors: the modules' and Adam's `state_dict()`s."""

    dims: tuple[int, int]
    encoder: dict[str, Tensor]
    decoder: dict[str, Tensor]
    optimizer: dict[str, Any]
    pending: list[Tensor]
    fvu: Tensor
    scales: dict[str, Tensor]


@dataclass
class CLVQState:
    """What a `CLVQTranscoder` checkpoint and merge hold: `tc.state()` (a copy), `tc.load_state(state)`."""

    steps: int
    vq: VQState
    """The codebook's state."""
    parts: PartsState | None
    """None before the first rows (the widths are not known)."""
    mixer: dict[str, Any] | None
    """The mixing buffer's `state_dict()` (the MLP decoder with a batch_size has one)."""

    def to_dict(self, config: dict[str, Any], codebook: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint layout (`state_dict()`); `codebook`: the codebook's config dict."""
        parts = None if self.parts is None else {f.name: getattr(self.parts, f.name) for f in fields(self.parts)}
        return {"config": config, "steps": self.steps, "vq": self.vq.to_dict(codebook), "parts": parts,
                "mixer": self.mixer}

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> CLVQState:
        """The state of a `to_dict` layout."""
        parts = state["parts"]
        if parts is not None:
            parts = PartsState(**{**parts, "dims": tuple(parts["dims"])})
        return cls(state["steps"], VQState.from_dict(state["vq"]), parts, state.get("mixer"))
