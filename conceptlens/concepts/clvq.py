"""CLVQTranscoder: a cross-layer VQ bottleneck that reads one site and reconstructs another.

    tc = CLVQTranscoder(n_codes=512)
    for x_src, x_tgt in stream:            # the same tokens at two sites: (N, d_src), (N, d_tgt)
        tc.update(x_src, x_tgt)
    tc.encode(x_src)                         # (N, K) one-hot code per token
    cs = tc.concept_set()                    # codes, and what each code writes at the target

After the CLVQ-VAE: an adaptive residual encoder z_e = (1 - a) h + a LayerNorm(W h + b),
a = 0.5 sigmoid(alpha) in [0, 0.5]; a `VQCodebook` (EMA, top-k temperature sampling) on
z_e with a straight-through estimator; a decoder (an MLP, or a small transformer over each
sequence's codes) reconstructing the target site. Loss: MSE(x_tgt, x_hat) +
commitment * MSE(z_e, sg(q)), minimised by Adam; the codebook itself moves only by EMA.

Where it differs from the released CLVQ-VAE, deliberately: its transformer decoder (6 layers,
8 heads, no causal mask) attends to z_e as memory, so the continuous encoding reaches the
reconstruction around the codes; ours attends to the codes only (memory = z_q), causal by
default, 2 layers and 4 heads, so the target is reconstructed from the codes alone and a code's
decoded effect (`stats["decoded"]`) is what it carries. The MLP decoder (the default) reads z_q
alone too. The perplexity term of its loss (weight 0 or 0.01) is left out (weight 0).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from conceptlens._checks import check_choice, known_kwargs
from conceptlens.concepts.base import ExtractorBase, NotFittedError
from conceptlens.concepts.buffer import MixingBuffer
from conceptlens.concepts.clvq_modules import ResidualEncoder
# re-exported, so that they stay importable from this module
from conceptlens.concepts.clvq_modules import pad_sequences as pad_sequences, sinusoids as sinusoids
from conceptlens.concepts.conceptset import ConceptSet
# the config, result and state types, and the merge, live in clvq_config.py and clvq_merge.py;
# re-exported here
from conceptlens.concepts.clvq_config import (DECODERS, CLVQConfig, CLVQState, CLVQStats, DecoderKind, PartsState,
                                              TranscoderParts)
from conceptlens.concepts.clvq_merge import merge_transcoders
from conceptlens.concepts.vq import VQCodebook
from conceptlens.concepts.vq_config import DISTANCES
from conceptlens.concepts.vq_math import fvu_from_sums, fvu_sums, laplace_smooth

SPACE = "clvq_z_e"
"""`ConceptSet.config["space"]` of CLVQ codes: the encoder's z_e space, not an activation site."""
__all__ = ["CLVQConfig", "CLVQState", "CLVQStats", "CLVQTranscoder", "DECODERS", "DecoderKind", "PartsState", "SPACE",
           "TranscoderParts", "pad_sequences", "sinusoids"]


class CLVQTranscoder(ExtractorBase):
    """A cross-layer VQ transcoder fitted online; see the module docstring.

    Its codes live in the encoder space: z_e has the source site's width and, since
    a <= 0.5, is at least half the source activation itself, but it is not the source site.
    `concept_set()` returns them as directions with `config["space"] = "clvq_z_e"` (a fit labels
    the set `"<source>-><target>:z_e"`, which names no site, so steering or projecting them at
    an activation site fails loudly instead of treating them as residual directions) and, in
    `stats["decoded"]` (K, d_tgt), what each code writes at the target site.
    """

    Config, State = CLVQConfig, CLVQState
    method = "clvq"

    @known_kwargs
    def __init__(self, n_codes: int, *, hidden: int = 1024, decoder: DecoderKind = "mlp",
                 commitment: float = 0.1, lr: float = 1e-3, batch_size: int | None = 1024,
                 buffer_size: int | None = None, layers: int = 2, heads: int = 4, causal: bool = True,
                 codebook: dict[str, Any] | None = None, seed: int = 0, dtype: str = "float32",
                 device: str | torch.device | None = None) -> None:
        self.config = CLVQConfig(n_codes, hidden, decoder, commitment, lr, batch_size, buffer_size,
                                 layers, heads, causal, dict(codebook or {}), seed, dtype)
        self._set_device(device)
        # The transcoder batches rows itself and calls train_step: no second mixing buffer.
        self.vq = VQCodebook(n_codes, batch_size=None, seed=seed, device=device, dtype=self.config.dtype,
                             **self.config.codebook)
        self.parts: TranscoderParts | None = None
        size = buffer_size or 4 * (batch_size or 1)
        self._mixer = MixingBuffer(size, seed=seed + 2) if decoder == "mlp" and batch_size else None
        self.steps = 0

    @property
    def encoder(self) -> ResidualEncoder:
        return self._ready().encoder

    # ---- streaming -------------------------------------------------------------------

    def update(self, x_src: Tensor, x_tgt: Tensor, sequence_ids: Tensor | None = None) -> None:
        """Consume aligned tokens x_src (N, d_src), x_tgt (N, d_tgt), optional sequence ids
        (N,): collect the first init_size rows for the codebook's initialisation, then one
        Adam + EMA step per batch_size rows. The MLP decoder draws its batches at random from
        a mixing buffer; the transformer takes consecutive rows, so sequences keep their
        order (one split across two steps is treated as two sequences)."""
        parts, batch = self._prepare(x_src, x_tgt, sequence_ids)
        rows = [torch.cat([p, b]) for p, b in zip(parts.pending, batch)]
        if not self.vq.is_initialised:
            n_init = self.vq.config.rows_to_init
            if len(rows[0]) < n_init:
                parts.pending = rows
                return
            self._initialise(parts, *(r[:n_init] for r in rows))
            rows = [r[n_init:] for r in rows]
        size = self.config.batch_size
        if self._mixer is None or size is None:
            parts.pending = self._consecutive_steps(parts, rows)
            return
        parts.pending = [r[:0] for r in rows]
        self._mixer.add(torch.cat(rows[:2], 1))
        while (mixed := self._mixer.take(size)) is not None:
            self._train_step(parts, *self._split(parts, mixed.to(rows[0].device)))

    def flush(self) -> None:
        """End of stream: initialise on what was collected (if at least n_codes rows) and
        train on the rows still held (the last batch may be short)."""
        parts = self.parts
        if parts is None:
            return
        if not self.vq.is_initialised and len(parts.pending[0]) >= self.config.n_codes:
            self._initialise(parts, *parts.pending)
            parts.pending = [p[:0] for p in parts.pending]
        size = self.config.batch_size
        if not self.vq.is_initialised:
            return
        if self._mixer is not None and size is not None:
            rest = self._mixer.drain()
            for batch in () if rest is None else rest.to(parts.fvu.device).split(size):
                self._train_step(parts, *self._split(parts, batch))
        elif len(parts.pending[0]):
            self._train_step(parts, *parts.pending)
            parts.pending = [p[:0] for p in parts.pending]

    def _consecutive_steps(self, parts: TranscoderParts, rows: list[Tensor]) -> list[Tensor]:
        """Steps on consecutive batch_size rows (all rows if None); returns the remainder."""
        size = self.config.batch_size or max(len(rows[0]), 1)
        n_full = len(rows[0]) // size
        for i in range(n_full):
            self._train_step(parts, *(r[i * size:(i + 1) * size] for r in rows))
        return [r[n_full * size:].clone() for r in rows]

    @staticmethod
    def _split(parts: TranscoderParts, rows: Tensor) -> tuple[Tensor, Tensor, None]:
        """Mixed rows [source | target] (N, d_src + d_tgt) -> source, target, no sequence ids."""
        return rows[:, : parts.dims[0]], rows[:, parts.dims[0]:], None

    def _train_step(self, parts: TranscoderParts, src: Tensor, tgt: Tensor, ids: Tensor | None) -> None:
        dtype = self.compute_dtype
        mixed = torch.autocast(src.device.type, dtype=dtype, enabled=dtype != torch.float32)
        with mixed:
            z_e = parts.encoder(src)                                   # (N, d_src)
        step = self.vq.train_step(z_e.detach())
        with mixed:
            z_q = z_e + (step.quantized.to(z_e.dtype) - z_e).detach()  # straight-through
            x_hat = self._decode(parts, z_q, ids)                      # (N, d_tgt)
        x_hat, z_e = x_hat.float(), z_e.float()                        # the losses in float32
        loss = F.mse_loss(x_hat, tgt) + self.config.commitment * F.mse_loss(z_e, step.quantized)
        parts.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        parts.optimizer.step()
        decay = self.vq.config.decay
        parts.fvu = decay * parts.fvu + (1 - decay) * fvu_sums(tgt, x_hat)
        self.steps += 1

    @staticmethod
    def _decode(parts: TranscoderParts, z: Tensor, ids: Tensor | None) -> Tensor:
        # Residual streams carry large means and norms: the decoder works on standardised
        # inputs and outputs (scales fixed at initialisation) so that Adam's lr means the same
        # at every site.
        s = parts.scales
        return s["tgt_mean"] + s["tgt_scale"] * parts.decoder((z - s["z_mean"]) / s["z_scale"], ids)

    def _prepare(self, x_src: Tensor, x_tgt: Tensor,
                 ids: Tensor | None) -> tuple[TranscoderParts, list[Tensor]]:
        if x_src.ndim != 2 or x_tgt.ndim != 2 or len(x_src) != len(x_tgt):
            raise ValueError(f"expected aligned (N, d_src) and (N, d_tgt) tensors; got "
                             f"{tuple(x_src.shape)} and {tuple(x_tgt.shape)}")
        if ids is None:
            if self.config.decoder == "transformer":
                raise ValueError("decoder='transformer' needs sequence_ids (N,) in update")
            ids = torch.zeros(len(x_src), dtype=torch.long, device=x_src.device)
        if ids.shape != (len(x_src),):
            raise ValueError(f"sequence_ids must have shape ({len(x_src)},); got {tuple(ids.shape)}")
        dims = (x_src.shape[1], x_tgt.shape[1])
        if self.parts is None:
            self.parts = TranscoderParts.build(self.config, dims, self.device or x_src.device)
        device = self.parts.fvu.device
        x_src, x_tgt, ids = x_src.to(device), x_tgt.to(device), ids.to(device)
        if dims != self.parts.dims:
            raise ValueError(f"expected widths (d_src, d_tgt)={self.parts.dims} (fixed by the first "
                             f"update); got {dims}")
        return self.parts, [x_src.float(), x_tgt.float(), ids.long()]

    def _initialise(self, parts: TranscoderParts, src: Tensor, tgt: Tensor, ids: Tensor) -> None:
        """Standardisation from the first init_size rows; the codebook initialises on their z_e."""
        with torch.no_grad():
            z = parts.encoder(src)
        parts.scales = {"z_mean": z.mean(0), "z_scale": _rms(z - z.mean(0)),
                        "tgt_mean": tgt.mean(0), "tgt_scale": _rms(tgt - tgt.mean(0))}
        self.vq.update(z)
        self.vq.flush()     # initialises on fewer than init_size rows when called by flush()
        # The paper's EMA codebook starts every count at 1 (sums = codes), so the first batches
        # move the codes at once; the codebook's own init weighs the init_size rows as one step.
        fit = self.vq.fitted
        assert fit is not None  # flush() initialises on the n_codes or more rows given here
        fit.counts = torch.ones_like(fit.counts)
        fit.sums = fit.codes * laplace_smooth(fit.counts, self.vq.config.eps)[:, None]

    # ---- evaluation ------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, x_src: Tensor) -> Tensor:
        """One-hot nearest code of each token: (N, d_src) -> (N, K) float."""
        parts = self._ready()
        return self.vq.encode(parts.encoder(x_src.float().to(parts.fvu.device)))

    @torch.no_grad()
    def decode(self, z: Tensor, sequence_ids: Tensor | None = None) -> Tensor:
        """What the decoder writes at the target site for encoder-space vectors z (N, d_src)."""
        return self._decode(self._ready(), z.float(), sequence_ids)

    @torch.no_grad()
    def reconstruct(self, x_src: Tensor, sequence_ids: Tensor | None = None) -> Tensor:
        """The target site predicted through the nearest codes: (N, d_src) -> (N, d_tgt)."""
        parts = self._ready()
        return self._decode(parts, self.vq.quantize(parts.encoder(x_src.float())), sequence_ids)

    def stats(self) -> CLVQStats:
        """Target FVU, codebook usage and perplexity, encoder mix for the fit report (nan
        before the codebook initialises)."""
        vq, parts, nan = self.vq.stats(), self.parts, float("nan")
        fvu = nan if parts is None else fvu_from_sums(parts.fvu)
        mix = nan if parts is None else parts.encoder.mix.item()
        return CLVQStats(fvu, vq.usage, vq.perplexity, mix, self.steps, vq.tokens)

    @torch.no_grad()
    def concept_set(self) -> ConceptSet:
        """Directions = codes (K, d_src) in encoder space; stats["decoded"] (K, d_tgt) = the
        decoder's output for each code alone (for the transformer: a one-token sequence)."""
        parts, codes = self._ready(), self.vq.concept_set()
        ids = torch.arange(len(codes), device=codes.directions.device)
        decoded = self._decode(parts, self.vq.codes, ids)
        weights = parts.encoder.state_dict()        # linear.*, norm.*, alpha (as shape (1,))
        encoder = {"codebook": self.vq.codes.clone(),
                   **{k: (v.reshape(-1) if k == "alpha" else v).clone() for k, v in weights.items()}}
        config = {**self.config_dict(), "d_target": parts.dims[1], "fit_stats": self.stats()._asdict(),
                  "space": SPACE}
        return ConceptSet(codes.directions, method=self.method, config=config, encoder=encoder,
                          stats={**codes.stats, "decoded": decoded})

    def _ready(self) -> TranscoderParts:
        if self.parts is None or not self.vq.is_initialised:
            raise NotFittedError(f"the transcoder is not initialised: it starts after "
                               f"init_size={self.vq.config.rows_to_init} tokens (or at flush())")
        return self.parts

    # ---- state: checkpoints and merges ----------------------------------------------

    def state(self) -> CLVQState:
        """A copy of everything a checkpoint or a merge needs: parameters, Adam moments, the codebook."""
        p = self.parts
        parts = None if p is None else PartsState(p.dims, p.encoder.state_dict(), p.decoder.state_dict(),
                                                  p.optimizer.state_dict(), p.pending, p.fvu, p.scales)
        mixer = None if self._mixer is None else self._mixer.state_dict()
        return copy.deepcopy(CLVQState(self.steps, self.vq.state(), parts, mixer))

    def load_state(self, state: CLVQState) -> None:
        """Continue from `state` (copied, on this extractor's device when it has one)."""
        state = copy.deepcopy(self._placed(state))  # Adam would keep (and count on) the given step tensors
        self.vq.load_state(state.vq)
        self.steps = state.steps
        if self._mixer is not None and state.mixer is not None:  # (a state without one leaves it as it is)
            self._mixer.load_state_dict(state.mixer)
        saved = state.parts
        if saved is None:
            self.parts = None
            return
        parts = self.parts = TranscoderParts.build(self.config, saved.dims, saved.fvu.device)
        parts.encoder.load_state_dict(saved.encoder)
        parts.decoder.load_state_dict(saved.decoder)
        parts.optimizer.load_state_dict(saved.optimizer)
        parts.pending, parts.fvu, parts.scales = saved.pending, saved.fvu, saved.scales

    def state_dict(self) -> dict[str, Any]:
        return self.state().to_dict(self.config_dict(), self.vq.config_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """`ExtractorBase.load_state_dict`; the codebook samples over the distance its saved state
        records (a transcoder saved before `VQConfig.distance` existed sampled over Euclidean ones,
        and resumes so; `codebook` options of the constructor cannot name it for an older state)."""
        super().load_state_dict(state)
        saved = state.get("vq", {}).get("config", {}) if isinstance(state.get("vq"), dict) else {}
        distance = saved.get("distance", VQCodebook.legacy_config["distance"])
        check_choice("the codebook's saved distance", distance, DISTANCES)
        self.vq.config.distance = distance

    def mark_shared_start(self) -> None:
        """Declare the current state the start of replicas (see `VQCodebook.mark_shared_start`)."""
        self.vq.mark_shared_start()

    def _merge(self, other: CLVQTranscoder) -> None:
        """Combine with a data-parallel replica (see `conceptlens.concepts.clvq_merge`). Rows either
        side holds for the initialisation are kept: a replica that has not initialised is fed the
        other's waiting rows, or becomes a copy of an initialised other and is then fed its own."""
        if other.parts is None:
            return
        if not other.vq.is_initialised:  # its rows wait for the initialisation: fed here, as one fed both
            if len(other.parts.pending[0]):
                self.update(*(r.clone() for r in other.parts.pending))
            return
        mine = self.parts.pending if self.parts is not None and not self.vq.is_initialised else None
        if mine is not None or self.parts is None:
            self.check_state({"config": other.config_dict()})  # it becomes a copy of the other
        self.load_state(merge_transcoders(self.state(), other.state(), self.vq.config.decay, self.vq.config.eps))
        if mine is not None and len(mine[0]):
            self.update(*mine)


def _rms(x: Tensor) -> Tensor:
    """Root mean square over all entries of x (N, d) (1 if x is all zeros)."""
    rms = x.pow(2).mean().sqrt()
    return torch.where(rms > 0, rms, torch.ones_like(rms))
