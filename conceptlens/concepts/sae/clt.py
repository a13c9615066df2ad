"""Cross-layer transcoders: each layer's latents write to its own and every later MLP output
(Ameisen et al. 2025, "Circuit Tracing"; Lindsey et al. 2024).

    clt = CrossLayerTranscoder(width=4 * 1024, k=16, seed=0)   # 4 layers x 1024 latents, 16 active per layer
    for xs, ys in stream:              # xs: L tensors (N, d_in), each block's MLP input; ys: L MLP outputs
        clt.update(xs, ys)             # lens.fit({(("blocks.0.mlp.in", ...), ("blocks.0.mlp_out", ...)): clt})
    ys_hat = clt.reconstruct(xs)       # L tensors (N, d_out)
    clt.fvu(xs, ys)                    # FVU per target layer

Layer l reads its MLP's input, z_l = TopK_k(x_l W_enc^l + b_enc^l), and target l' is written by
the latents of every layer at or before it, y_hat_l' = sum_{l <= l'} z_l W_dec^{l->l'} + b_dec^l';
the loss is summed over targets. The Circuit Tracing paper gates with JumpReLU and a tanh
sparsity penalty; the gate here is TopK per layer (k active latents of each layer per token),
with AuxK for dead latents, which needs no penalty coefficient. `width` counts the latents of all
layers (width / L per layer); latent j belongs to layer j // (width / L).

The decoder is one `(width, L * d_out)` matrix whose blocks below the diagonal (a latent
writing an earlier layer) are held at zero by a mask; each latent's row (all its targets) is kept
at unit norm. Latents start from tokens of the first batch, as a `Transcoder`'s do. Each site has
its own warm-up scale (multisite.py), folded on export: W_enc^l rows times the input scale,
W_dec and b_dec columns divided by the output scales; latents stay in the trained units.
Replicas merge by averaging; `fit(distributed=True)` gives every rank the global rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.concepts.sae.base import Code
from conceptlens.concepts.sae.crosscoder import fvu_per_site
from conceptlens.concepts.sae.multisite import MultiSite
from conceptlens.concepts.sae.stats import geometric_median
from conceptlens.concepts.sae.topk import TopKConfig, TopKSAE, sparse_decode


@dataclass(kw_only=True)
class CLTConfig(TopKConfig):
    """Cross-layer transcoder hyper-parameters: `width` latents in all (split evenly over the
    layers), `k` active latents per layer and token; the rest as `TopKSAE`."""


class CrossLayerTranscoder(MultiSite, TopKSAE):
    """z_l = TopK(x_l W_enc^l + b_enc^l); y_hat_l' = sum_{l <= l'} z_l W_dec^{l->l'} + b_dec^l'."""

    Config = CLTConfig
    method = "clt"
    distributed = None

    def __init__(self, config: CLTConfig | None = None, /, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._init_sites()

    # by design a CLT's update takes (inputs, outputs), not one row block
    def update(self, inputs: Sequence[Tensor], outputs: Sequence[Tensor] | None = None) -> None:  # type: ignore[override]
        """Buffer the same tokens at each layer's MLP input (L tensors `(N, d_in)`) and output (L `(N, d_out)`)."""
        if outputs is None or isinstance(inputs, Tensor) or isinstance(outputs, Tensor):
            raise TypeError(f"{type(self).__name__}.update takes (inputs, outputs): a sequence of L MLP inputs and "
                            "one of L MLP outputs; fit it with a key ((input sites...), (output sites...))")
        super().update(self._join([tuple(inputs), tuple(outputs)]))

    def _check_sites(self, shape: list[int], widths: list[int]) -> None:
        L = shape[0]
        if shape[1] != L:
            raise ValueError(f"{type(self).__name__} needs as many output sites as input sites; got {shape}")
        if len(set(widths[:L])) > 1 or len(set(widths[L:])) > 1:
            raise ValueError(f"every input site needs one width and every output site one width; got {widths}")
        if self.config.width % L:
            raise ValueError(f"width={self.config.width} does not split evenly over {L} layers")
        if self.config.k > self.config.width // L:
            raise ValueError(f"k={self.config.k} exceeds the {self.config.width // L} latents of a layer")

    # ---- geometry -------------------------------------------------------------------------
    @property
    def layers(self) -> int:
        return self._sites()[0][0]

    def _dims(self) -> tuple[int, int, int, int]:
        """(L, d_in, d_out, latents per layer)."""
        L, widths = self.layers, self._sites()[1]
        return L, widths[0], widths[L], self.config.width // L

    def _mask(self, device: torch.device) -> Tensor:
        """`(width, L * d_out)`: latent of layer l may write target l' iff l <= l'."""
        L, _, d_out, n = self._dims()
        src = torch.arange(L * n, device=device) // n
        dst = torch.arange(L * d_out, device=device) // d_out
        return (src[:, None] <= dst[None, :]).float()

    # ---- the model ------------------------------------------------------------------------
    def _forward(self, x: Tensor, w: dict[str, Tensor]) -> tuple[Tensor, Code, Tensor]:
        L, d_in, _, _ = self._dims()
        x_in, y = x[:, : L * d_in], x[:, L * d_in:]
        code = self._encode(x_in.to(self.compute_dtype), w, train=True)
        return y, code, self._decode(code.z, w, train=True)

    def _encode(self, x: Tensor, w: dict[str, Tensor], train: bool) -> Code:
        L, d_in, _, n = self._dims()
        pre = torch.einsum("nld,ldk->nlk", x.reshape(-1, L, d_in), w["W_enc"]) + w["b_enc"]  # (N, L, n)
        values, indices = pre.topk(self.config.k, dim=-1, sorted=False)  # per layer
        z = torch.zeros_like(pre).scatter(-1, indices, values.relu())
        return Code(z.reshape(-1, L * n), pre.reshape(-1, L * n))

    def _decode(self, z: Tensor, w: dict[str, Tensor], train: bool = False) -> Tensor:
        if train:  # at most k per layer: gather the rows
            return sparse_decode(z, self.layers * self.config.k, w["W_dec"]) + w["b_dec"]
        return z @ w["W_dec"] + w["b_dec"]

    def _weights(self) -> dict[str, Tensor]:
        w = {**self.params, **self.buffer_dict}
        return {**w, "W_dec": w["W_dec"] * self._mask(w["W_dec"].device)}

    def _init_params(self, x: Tensor) -> dict[str, Tensor]:
        """Latent j of layer l starts at a token r_j of the first batch: its encoder column is the
        token's centred input at layer l (unit norm), its decoder row the token's centred outputs
        at layers l..L (unit norm); b_enc centres the pre-activations, b_dec at the outputs' centre;
        then the encoder is scaled so that the first batch's prediction has its targets' norm."""
        L, d_in, d_out, n = self._dims()
        x = x.cpu()
        x_in, y = x[:, : L * d_in].reshape(-1, L, d_in), x[:, L * d_in:]
        rows = torch.cat([torch.randperm(x.shape[0], generator=self.trainer.generator)
                          for _ in range(-(-self.config.width // x.shape[0]))])[: self.config.width].reshape(L, n)
        centre = x_in.mean(0)  # (L, d_in)
        W_enc = torch.stack([(x_in[rows[l], l] - centre[l]).T for l in range(L)])  # (L, d_in, n)
        W_enc = W_enc / W_enc.norm(dim=1, keepdim=True).clamp(min=1e-12)
        b_enc = -torch.einsum("ld,ldk->lk", centre, W_enc)
        W_dec = (y[rows.reshape(-1)] - y.mean(0)) * self._mask(torch.device("cpu"))  # (width, L * d_out)
        W_dec = W_dec / W_dec.norm(dim=1, keepdim=True).clamp(min=1e-12)
        init = self.config.b_dec_init
        b_dec = geometric_median(y) if init == "geometric_median" else y.mean(0) if init == "mean" else y[0] * 0
        params = {"W_enc": W_enc, "b_enc": b_enc, "W_dec": W_dec, "b_dec": b_dec}
        # one positive scale on the encoder (TopK picks the same latents) so that the first
        # prediction has the targets' size: latents aligned with tokens overshoot k-fold otherwise
        y_hat = self._decode(self._encode(x[:, : L * d_in], params, train=False).z, {**params, "b_dec": b_dec * 0})
        scale = ((y - b_dec).pow(2).sum() / y_hat.pow(2).sum().clamp(min=1e-12)).sqrt()
        return {**params, "W_enc": W_enc * scale, "b_enc": b_enc * scale}

    def _fold(self, w: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
        L, d_in, _, _ = self._dims()
        c = self.columns()
        c_in, c_out = c[: L * d_in].reshape(L, d_in, 1), c[L * d_in:]
        return {"W_enc": w["W_enc"] * c_in, "b_enc": w["b_enc"], "W_dec": w["W_dec"] / c_out,
                "b_dec": w["b_dec"] / c_out}

    # ---- raw-space use --------------------------------------------------------------------
    def _inputs(self, inputs: Sequence[Tensor] | Tensor) -> Tensor:
        x = inputs if isinstance(inputs, Tensor) else torch.cat([t.to(inputs[0].device) for t in inputs], 1)
        L, d_in, _, _ = self._dims()
        if x.ndim != 2 or x.shape[1] != L * d_in:
            got = tuple(x.shape) if isinstance(inputs, Tensor) else [tuple(t.shape) for t in inputs]
            raise ValueError(f"expected {L} inputs of width {d_in} (or their concatenation); got {got}")
        return x.to(self.tensor_device).float()

    @torch.no_grad()
    def encode(self, inputs: Sequence[Tensor] | Tensor) -> Tensor:
        """Each layer's raw MLP input -> latents `(N, width)`, layer by layer."""
        return self._encode(self._inputs(inputs), self._raw(), train=False).z

    @torch.no_grad()  # by design the reconstruction is one tensor per layer, not one row block
    def reconstruct(self, inputs: Sequence[Tensor] | Tensor) -> list[Tensor]:  # type: ignore[override]
        """Each layer's raw MLP input -> each layer's MLP output predicted, L tensors `(N, d_out)`."""
        raw = self._raw()
        y = self._decode(self._encode(self._inputs(inputs), raw, train=False).z, raw)
        return list(y.split(self._dims()[2], dim=1))

    def fvu(self, inputs: Sequence[Tensor], outputs: Sequence[Tensor]) -> list[float]:
        """FVU at each target layer for held-out rows."""
        return fvu_per_site([t.float() for t in outputs], self.reconstruct(inputs))

    def concept_set(self) -> ConceptSet:
        """Decoder rows `(width, L * d_out)`: what each latent writes at every target layer (zero at
        layers before its own); W_enc `(L, d_in, width / L)` comes along."""
        cs = super().concept_set()
        cs.config.update(widths=list(self._sites()[1][self.layers:]), layers=self.layers)
        return cs
