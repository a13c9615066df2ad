"""Attention probabilities from the q/k an attention function receives, as eager attention computes them.

`eager_pattern(module, query, key, args, kwargs)` -> (B, H, T, S): scores q.k^T times the
module's scaling, soft-capped if the call asks for it, plus the mask / position bias the
model passed (additive float, or boolean), then a float32 softmax; attention sinks (one per
head, GPT-OSS; or one per head and query, Inkling 2) take part in the softmax and are dropped
afterwards. Dropout is not applied.

The mask is the one the call's kernel applies, which is not always the tensor it was given:
- sdpa (and any kernel but eager) receives no mask for an unpadded causal batch and masks by
  `is_causal` instead (the call's `is_causal`, else the module's, else True; only with more
  than one query), upper-left aligned as `scaled_dot_product_attention` aligns it;
- flex attention receives a `BlockMask`, whose `mask_mod` is evaluated at every (query, key).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def eager_pattern(module: nn.Module, query: Tensor, key: Tensor, args: tuple, kwargs: dict,
                  implementation: str = "eager") -> Tensor:
    mask = kernel_mask(module, query, key, args[0] if args else kwargs.get("attention_mask"), kwargs,
                       implementation)
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    scaling = kwargs.get("scaling", args[2] if len(args) > 2 else None)
    if scaling is None:
        scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
    scores = torch.matmul(query.float(), key.float().transpose(2, 3)) * scaling
    softcap = kwargs.get("softcap")
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    bias = kwargs.get("position_bias")  # T5-style relative position bias
    if isinstance(bias, Tensor):
        scores = scores + bias.float()[..., : scores.shape[-2], : key.shape[-2]]
    if mask is not None:
        mask = mask[..., : key.shape[-2]]
        # a boolean mask as eager's additive one (the dtype's minimum, not -inf): a query with no key
        # left (a pad) gets eager's uniform row, not NaN
        scores = (scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool
                  else scores + mask.float())
    sinks = kwargs.get("s_aux", kwargs.get("sinks", getattr(module, "sinks", None)))
    sink = None
    if isinstance(sinks, Tensor) and sinks.numel() == query.shape[1]:
        sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    elif isinstance(sinks, Tensor) and sinks.ndim == 4 and sinks.shape[-1] == 1:  # one per query (Inkling 2)
        sink = sinks.float()[..., -scores.shape[-2]:, :].expand(*scores.shape[:-1], 1)
    if sink is not None:
        return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.softmax(scores, dim=-1)


def kernel_mask(module: nn.Module, query: Tensor, key: Tensor, mask: object, kwargs: dict,
                implementation: str) -> Tensor | None:
    """The mask the kernel applies (boolean True = attend, or additive float), or None for none."""
    if isinstance(mask, Tensor):
        return mask
    T, S = query.shape[-2], key.shape[-2]
    if mask is not None and hasattr(mask, "mask_mod"):  # flex attention's BlockMask
        from torch.nn.attention.flex_attention import create_mask

        return create_mask(mask.mask_mod, query.shape[0], 1, T, S, device=query.device)
    if mask is not None or implementation == "eager":
        return None
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    if T <= 1 or not causal:
        return None
    return torch.ones(T, S, dtype=torch.bool, device=query.device).tril()  # key j <= query i
