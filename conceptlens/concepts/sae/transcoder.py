"""Transcoders: a sparse dictionary that reads one site and writes another (Dunefsky et al. 2024).

    tc = Transcoder(width=4608, seed=0)           # or SkipTranscoder (Paulo et al. 2025)
    for x_in, x_out in stream:                    # the same tokens at an MLP's input and output
        tc.update(x_in, x_out)                    # lens.fit({("blocks.3.resid_mid", "blocks.3.mlp_out"): tc})
    z = tc.encode(x_in)                           # (N, width) latents, in raw units
    y = tc.reconstruct(x_in)                      # (N, d_out): the MLP's output predicted sparsely
    cs = tc.concept_set()                         # directions: what each latent writes at the output

z = ReLU(x_in W_enc + b_enc), y_hat = z W_dec + b_dec (+ x_in W_skip for the skip variant, a dense
linear path that starts at zero); loss ||y - y_hat||^2 + lambda sum_i z_i ||W_dec,i||: the
April 2024 ReLU recipe of `ReLUSAE` (free decoder norms, L1 weighted by them, `l1` in units of
the centred target spread), with the input not shifted by b_dec (it has the output's width).
This is SAELens's "transcoder" / "skip_transcoder" architecture, so `export_transcoder` and
`import_transcoder` exchange files with it exactly.

Each side has its own warm-up scale (x_n = s_in x_in, y_n = s_out y with E||.||^2 = width of
that side), folded on export: W_enc unchanged, b_enc / s_in, W_dec s_in / s_out, b_dec / s_out,
W_skip s_in / s_out, so raw latents are the normalised ones divided by s_in. Rows travel through
the mixing buffer as [x_in | y]. `fit(distributed=True)` gives every rank the global rows, so it
needs nothing of its own; the per-step gradient all-reduce for callers who feed each rank its own
rows (`comm`) assumes one site and is not offered; replicas merge by averaging as other SAEs do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.concepts.sae.base import Code, SparseAutoencoder
from conceptlens.concepts.sae.buffers import merge_warm_up
from conceptlens.concepts.sae.relu import ReLUConfig, ReLUSAE
from conceptlens.concepts.sae.stats import geometric_median


@dataclass(kw_only=True)
class TranscoderConfig(ReLUConfig):
    """Transcoder hyper-parameters: those of `ReLUSAE` (b_dec_init applies to the output side)."""


class Transcoder(ReLUSAE):
    """z = ReLU(x_in W_enc + b_enc), y_hat = z W_dec + b_dec; see the module docstring."""

    Config = TranscoderConfig
    method = "transcoder"
    distributed = None
    own_state = ("d_in",)  # saved with the state
    skip: ClassVar[bool] = False
    directions_at: ClassVar[str] = "target"
    """The decoder rows live at the output site: a fitted set is labelled with it (fit_keys.where)."""

    def __init__(self, config: TranscoderConfig | None = None, /, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.d_in: int | None = None

    # ---- streaming pairs ----------------------------------------------------------------
    def update(self, x_in: Tensor, x_out: Tensor | None = None) -> None:
        """Buffer the pairs of rows `(N, d_in)`, `(N, d_out)`: the same tokens at the two sites."""
        if x_out is None:
            raise TypeError(f"{type(self).__name__}.update takes (x_in, x_out): the same tokens at its input and "
                            "output sites; fit it with a (source, target) key")
        for name, x in (("x_in", x_in), ("x_out", x_out)):
            if not isinstance(x, Tensor) or x.ndim != 2 or not x.is_floating_point():
                got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(f"{type(self).__name__}.update expects float tensors (N, d); {name} is {got}")
        if x_in.shape[0] != x_out.shape[0]:
            raise ValueError(f"x_in and x_out must hold the same tokens; got {x_in.shape[0]} and {x_out.shape[0]} rows")
        if self.d_in is None:
            self.d_in = x_in.shape[1]
        elif x_in.shape[1] != self.d_in:
            raise ValueError(f"{type(self).__name__} was fitted on input width {self.d_in}; got {x_in.shape[1]}")
        super().update(torch.cat([x_in, x_out.to(x_in.device, x_in.dtype)], 1))

    def _sides(self) -> tuple[int, int]:
        """(d_in, d): the input site's width and that of a row [x_in | y]; NotFittedError before the first."""
        if self.d_in is None or self.d is None:
            raise self._not_fitted()
        return self.d_in, self.d

    def _split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        d_in = self._sides()[0]
        return x[:, :d_in], x[:, d_in:]

    def _warm_up(self, rows: Tensor) -> None:
        """Sum ||x_in||^2 and ||y||^2 (float64) over the warm-up rows, for one scale per side."""
        x_in, y = self._split(rows.double())
        sums = torch.stack([x_in.pow(2).sum(), y.pow(2).sum()]).cpu()
        self.buffer_dict["warm_sq"] = self.buffer_dict["warm_sq"] + sums if "warm_sq" in self.buffer_dict else sums

    def _set_scale(self, sum_sq: float, rows: int) -> None:
        super()._set_scale(sum_sq, rows)
        n, sums = rows, self.buffer_dict.pop("warm_sq")
        d_in, d = self._sides()
        widths = torch.tensor([d_in, d - d_in], dtype=torch.float64)
        if not (sums > 0).all():
            raise ValueError(f"the first {n} rows are all zero on one side; cannot normalise their scale")
        scales = (widths * n / sums).sqrt().float().to(self.tensor_device)  # (2,) s_in, s_out
        self.buffer_dict = {"scale_in": scales[0], "scale_out": scales[1]}

    def _normalise(self, x: Tensor) -> Tensor:
        x_in, y = self._split(x)
        return torch.cat([x_in * self.buffer_dict["scale_in"], y * self.buffer_dict["scale_out"]], 1)

    def _forward(self, x: Tensor, w: dict[str, Tensor]) -> tuple[Tensor, Code, Tensor]:
        x_in, y = self._split(x)
        code = self._encode(x_in.to(self.compute_dtype), w, train=True)
        return y, code, self._output(x_in.to(self.compute_dtype), code.z, w, train=True)

    def _start(self, x: Tensor) -> None:
        if "l1_unit" not in self.buffer_dict:  # the L1's unit: the target's spread
            y = self._split(x)[1]
            self.buffer_dict["l1_unit"] = ((y - y.mean(0)).pow(2).sum(1).mean() / y.shape[1]).sqrt().float()
        super()._start(x)

    # ---- the model ----------------------------------------------------------------------
    def _init_params(self, x: Tensor) -> dict[str, Tensor]:
        """Latent j starts at a token r_j of the first batch (distinct while the batch lasts):
        its encoder column is the token's centred input, unit norm, and its decoder row the
        token's centred target at norm `decoder_init_norm` (the tied start W_enc = W_dec^T of
        an SAE has no counterpart across two sites; random untied starts left every latent dead
        on the planted test). b_enc = -c W_enc with c the inputs' centre, so pre-activations start
        centred; b_dec at the targets' geometric median / mean / zero; W_skip zero."""
        x_in, y = (t.cpu() for t in self._split(x))
        n, width, init = x.shape[0], self.config.width, self.config.b_dec_init
        rows = torch.cat([torch.randperm(n, generator=self.trainer.generator) for _ in range(-(-width // n))])[:width]
        centre_in = geometric_median(x_in) if init == "geometric_median" else x_in.mean(0)
        b_dec = (geometric_median(y) if init == "geometric_median" else y.mean(0) if init == "mean"
                 else torch.zeros(y.shape[1]))
        W_enc = (x_in[rows] - centre_in).T  # (d_in, width)
        W_enc = W_enc / W_enc.norm(dim=0).clamp(min=1e-12)
        W_dec = y[rows] - y.mean(0)  # (width, d_out)
        W_dec = W_dec / W_dec.norm(dim=1, keepdim=True).clamp(min=1e-12) * self.config.decoder_init_norm
        params = {"W_enc": W_enc, "b_enc": -centre_in @ W_enc, "W_dec": W_dec, "b_dec": b_dec}
        if self.skip:
            params["W_skip"] = torch.zeros(x_in.shape[1], y.shape[1])
        return params

    def _weights(self) -> dict[str, Tensor]:
        return {**self.params, "l1_unit": self.buffer_dict.get("l1_unit", torch.ones(()))}

    def _encode(self, x: Tensor, w: dict[str, Tensor], train: bool) -> Code:
        pre = x @ w["W_enc"] + w["b_enc"]  # (N, width): no b_dec shift, it has the output's width
        return Code(pre.relu(), pre)

    def _output(self, x_in: Tensor, z: Tensor, w: dict[str, Tensor], train: bool = False) -> Tensor:
        y_hat = self._decode(z, w, train)  # (N, d_out)
        return y_hat + x_in @ w["W_skip"] if "W_skip" in w else y_hat

    def _fold(self, w: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
        s_in, s_out = self.buffer_dict["scale_in"], self.buffer_dict["scale_out"]
        raw = {"W_enc": w["W_enc"], "b_enc": w["b_enc"] / s_in, "W_dec": w["W_dec"] * (s_in / s_out),
               "b_dec": w["b_dec"] / s_out}
        if "W_skip" in w:
            raw["W_skip"] = w["W_skip"] * (s_in / s_out)
        return raw

    # ---- raw-space use and persistence ----------------------------------------------------
    @torch.no_grad()
    def reconstruct(self, x_in: Tensor) -> Tensor:
        """The output site predicted from the input site: `(N, d_in)` -> `(N, d_out)` (with the skip path)."""
        x_in = x_in.to(self.tensor_device).float()
        raw = self._raw()
        return self._output(x_in, self._encode(x_in, raw, train=False).z, raw)

    def concept_set(self) -> ConceptSet:
        """Decoder rows `(width, d_out)` as directions (they live at the OUTPUT site); the encoder
        (W_enc `(d_in, width)`, b_enc, b_dec, W_skip) comes along."""
        cs = super().concept_set()
        cs.config["d_in"] = self.d_in
        return cs

    def _merge(self, other: SparseAutoencoder) -> None:
        if not isinstance(other, Transcoder):
            raise TypeError(f"can only merge a {type(self).__name__} with another; got {type(other).__name__}")
        if self.d_in is not None and other.d_in is not None and other.d_in != self.d_in:
            raise ValueError(f"cannot merge a transcoder with input width {other.d_in} into one of width {self.d_in}")
        self.d_in = self.d_in if self.d_in is not None else other.d_in
        merge_warm_up(self, other)
        super()._merge(other)


class SkipTranscoder(Transcoder):
    """A transcoder with a dense linear skip path: y_hat = z W_dec + b_dec + x_in W_skip."""

    method = "skip_transcoder"
    skip = True
