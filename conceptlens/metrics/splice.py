"""CE-loss recovered: splice a reconstruction into a site and see what next-token loss it costs.

    result = splice_ce(lens, "blocks.10.resid_out", sae, batches)   # sae: anything with reconstruct(x)
    result.recovered      # 1.0 = splicing costs nothing; 0.0 = as bad as zeroing the site

Each batch runs three times: clean, with the site's activations replaced by
`reconstruction(x)` (`x`: `(N, d)` rows of real tokens; q/k/v sites give their heads
concatenated, `(N, H * d_head)`, as the fit engine does), and with them replaced by zeros.
The loss is the mean next-token cross-entropy over real tokens (a token counts when it and
the token before it are not padding). By default the first real token of each sequence is
never replaced: it is the attention sink that fits leave out (see `conceptlens.filters`),
and an SAE that never saw it would decide the result alone.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, NamedTuple

import torch
from torch import Tensor

from conceptlens.devices import input_device
from conceptlens.interface import AttachedModel
from conceptlens.metrics.faithfulness import next_token_loss_sum
from conceptlens.metrics.quality import ce_loss_recovered

Reconstruction = Callable[[Tensor], Tensor]
"""`(N, d)` rows -> `(N, d)` reconstructed rows."""


class SpliceResult(NamedTuple):
    clean: float
    """mean next-token cross-entropy (nats) of the unchanged model"""
    spliced: float
    """... with the reconstruction spliced in"""
    zero_ablated: float
    """... with the site set to zeros"""
    recovered: float
    """(zero_ablated - spliced) / (zero_ablated - clean)"""
    tokens: int
    """number of predicted tokens the means are over"""


def splice_mask(mask: Tensor, skip_first: bool = True) -> Tensor:
    """`(B, T)` bool: the tokens to replace, i.e. real tokens, minus each sequence's first one
    when `skip_first` (works with left and right padding)."""
    real = mask != 0
    if not skip_first:
        return real
    return real & (real.long().cumsum(1) > 1)


def _as_function(reconstruction: Any) -> Reconstruction:
    if callable(getattr(reconstruction, "reconstruct", None)):
        return reconstruction.reconstruct
    if callable(reconstruction):
        return reconstruction
    raise TypeError(f"reconstruction must have a reconstruct(x) method (an SAE) or be a function (N, d) -> (N, d); "
                    f"got {type(reconstruction).__name__}")


def _replacer(fn: Reconstruction, where: Tensor) -> Callable[[Tensor], Tensor]:
    """Site hook replacing the rows `where` (B, T) of x `(B, T, ...)` by `fn` of them."""

    def replace(x: Tensor) -> Tensor:
        chosen = where.to(x.device)
        rows = x[chosen]  # (N, ...)
        flat = rows.flatten(1)  # (N, d); heads concatenated for q/k/v sites
        new = fn(flat.float())
        if tuple(new.shape) != tuple(flat.shape):
            raise ValueError(f"reconstruction returned shape {tuple(new.shape)} for rows of shape {tuple(flat.shape)}")
        out = x.clone()
        out[chosen] = new.to(device=x.device, dtype=x.dtype).reshape(rows.shape)
        return out

    return replace


def predicts_next_token(model: Any) -> bool:
    """Whether `model` is a decoder-only language model: its logits predict each next token."""
    return not getattr(model.config, "is_encoder_decoder", False) and getattr(model, "can_generate", lambda: False)()


def _check_model(lens: AttachedModel) -> None:
    if not predicts_next_token(lens.model):
        raise ValueError(f"CE-loss recovered needs a decoder-only language model; {type(lens.model).__name__} "
                         "is not one (use FVU for encoders)")


@torch.no_grad()
def splice_ce(lens: AttachedModel, site: str, reconstruction: Any, batches: Mapping[str, Tensor] | Iterable[Mapping[str, Tensor]],
              *, skip_first: bool = True) -> SpliceResult:
    """Next-token loss clean, spliced and zero-ablated at `site`, and the fraction recovered.

        splice_ce(lens, "blocks.10.resid_out", sae, tok(texts, return_tensors="pt", padding=True))

    `reconstruction`: an object with `reconstruct(x)` (SAEs) or a function `(N, d) -> (N, d)`;
    `batches`: one tokenised batch or an iterable of them (`input_ids`, optional
    `attention_mask`). See the module docstring for what is replaced and counted.
    """
    _check_model(lens)
    fn = _as_function(reconstruction)
    zeros: Reconstruction = torch.zeros_like
    name = lens.site(site).name
    device = input_device(lens.model)
    totals = torch.zeros(3, dtype=torch.float64)
    count = 0
    for batch in [batches] if isinstance(batches, Mapping) else batches:
        batch = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask
        where = splice_mask(mask, skip_first)
        for i, replace in enumerate((None, fn, zeros)):
            if replace is None:
                logits = lens.model(**batch).logits
            else:
                with lens.hook(name, _replacer(replace, where)):
                    logits = lens.model(**batch).logits
            total, n = next_token_loss_sum(logits, ids, mask)
            totals[i] += total
        count += n
    if count == 0:
        raise ValueError("the batches hold no next-token prediction between two real tokens")
    clean, spliced, zero = (totals / count).tolist()
    return SpliceResult(clean, spliced, zero, ce_loss_recovered(clean, spliced, zero), count)
