"""Token bookkeeping: which rows of a forward are real tokens, and where they sit.

A pre-hook on each stack module (the base model, or its encoder / decoder) records that
stack's inputs; `StackInputs.meta(T)` turns them into a per-token keep mask, absolute
positions (through left padding and the KV cache) and token ids for a tensor of length T.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor, nn


class TokenMeta(NamedTuple):
    """Per-row bookkeeping of captured activations.

    Flat captures give `(N,)` tensors, one entry per kept token, in the order of the rows of
    every captured site; `keep_shape=True` captures give `(B, T)` tensors. `keep` is always
    the `(B, T)` mask of tokens that were kept (not padding, not dropped special tokens).
    """

    row: Tensor
    """Batch row of each token."""
    position: Tensor
    """Absolute position: index among the sequence's real tokens, counting cached ones."""
    token: Tensor
    """Token id (-1 when the forward got embeddings instead of ids)."""
    keep: Tensor
    """(B, T) bool mask of kept tokens."""


@dataclass
class StackInputs:
    """What one stack was called with, reduced to what the bookkeeping needs."""

    input_ids: Tensor | None = None
    attention_mask: Tensor | None = None
    past: Tensor | int = 0
    """Cached length before this forward: an int, or `cache_position` (T,)."""

    def key_mask(self) -> Tensor | None:
        """(B, S) mask of real tokens, cached ones included, or None where it cannot be told.

        A 2-D mask is taken as given. transformers' own 4-D masks (or its mapping of them per
        layer type, which `generate` passes with a static cache) give it as the keys the last
        query may attend among the first `past + T`: left padding is the only masked key there.
        """
        mask = self.attention_mask
        if isinstance(mask, dict):
            mask = mask.get("full_attention", next(iter(mask.values()), None))
        if isinstance(mask, Tensor) and mask.ndim == 4:
            past = self.past
            total = int(past[-1]) + 1 if isinstance(past, Tensor) else past + mask.shape[2]
            row = mask[:, 0, -1, :total]
            mask = row if row.dtype == torch.bool else row == 0  # additive masks: 0 where attended
        return mask if isinstance(mask, Tensor) and mask.ndim == 2 else None

    def meta(self, batch: int, length: int, device: torch.device, special_ids: Tensor | None = None) -> TokenMeta:
        """Bookkeeping for a `(batch, length, ...)` tensor of this stack. Positions past the
        stack's `input_ids` are padding the model appended (Reformer pads to its chunk length,
        keeping the padding in its blocks): no token, not kept."""
        ids = self.input_ids
        real = ids.shape[1] if isinstance(ids, Tensor) and ids.ndim == 2 and ids.shape[0] == batch else length
        if 0 < real < length:
            inner = self.meta(batch, real, device, special_ids)
            extra = length - real
            position = torch.cat([inner.position, inner.position[:, -1:] + torch.arange(1, extra + 1, device=device)], 1)
            return TokenMeta(torch.arange(batch, device=device)[:, None].expand(batch, length), position,
                             torch.cat([inner.token, inner.token.new_full((batch, extra), -1)], 1),
                             torch.cat([inner.keep, inner.keep.new_zeros((batch, extra))], 1))
        mask = self.key_mask()
        if mask is not None and (mask.shape[0] != batch or mask.shape[1] < length):
            mask = None  # 4-D or unrelated mask: every row counts
        if mask is not None:
            mask = mask.to(device)
            keep = mask[:, -length:].bool()
            position = (mask.long().cumsum(-1) - 1)[:, -length:].clamp(min=0)
        else:
            keep = torch.ones(batch, length, dtype=torch.bool, device=device)
            past = self.past
            start = past.to(device) if isinstance(past, Tensor) else past + torch.arange(length, device=device)
            position = start.reshape(1, -1).expand(batch, length) if start.numel() == length else \
                torch.arange(length, device=device).expand(batch, length)
        ids = self.input_ids
        if ids is not None and ids.ndim == 2 and ids.shape[0] == batch and ids.shape[1] >= length:
            token = ids[:, -length:].to(device)
            if special_ids is not None:
                keep = keep & ~torch.isin(token, special_ids.to(device))
        else:
            token = torch.full((batch, length), -1, dtype=torch.long, device=device)
        row = torch.arange(batch, device=device)[:, None].expand(batch, length)
        return TokenMeta(row, position, token, keep)


class InputRecorder:
    """Reads a stack's forward arguments by name (positional or keyword)."""

    def __init__(self, stack: nn.Module) -> None:
        self.signature = inspect.signature(stack.forward)

    def __call__(self, args: tuple, kwargs: dict[str, Any]) -> StackInputs:
        try:
            bound = self.signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = dict(kwargs)
        extra = bound.get("kwargs", {})
        get = lambda name: bound.get(name, extra.get(name))  # noqa: E731
        past: Tensor | int = 0
        if get("cache_position") is not None:
            past = get("cache_position")
        else:
            cache = get("past_key_values") or get("cache")
            if cache is not None and hasattr(cache, "get_seq_length"):
                past = int(cache.get_seq_length())
        return StackInputs(get("input_ids"), get("attention_mask"), past)


class TokenTracker:
    """Records each stack's inputs during forwards and serves `TokenMeta` for its tensors.

    `register(hooks, handles)` adds a forward pre-hook on every stack module; `on_start(stack)`
    (optional) runs when a stack's forward begins. Metas are cached until the next forward.
    """

    def __init__(self, stacks: dict[str, nn.Module], special_ids: Tensor | None = None,
                 on_start: Callable[[str], None] | None = None) -> None:
        self.stacks = stacks
        self.special_ids = special_ids
        self.on_start = on_start
        self.inputs: dict[str, StackInputs] = {}
        self._cache: dict[tuple[str, int, int, torch.device], TokenMeta] = {}

    def register(self, hooks, handles) -> None:
        """Add a pre-hook on every stack, through `hooks` (the model's HookManager), to `handles`."""
        for name, stack in self.stacks.items():
            handles.add(hooks.pre_hook(stack, self._pre_hook(name, InputRecorder(stack)), with_kwargs=True))

    def _pre_hook(self, name: str, recorder: InputRecorder):
        def hook(module, args, kwargs):
            self.inputs[name] = recorder(args, kwargs)
            self._cache = {}
            if self.on_start is not None:
                self.on_start(name)

        return hook

    def meta(self, stack: str, batch: int, length: int, device: torch.device) -> TokenMeta:
        key = (stack, batch, length, torch.device(device))  # a device_map model reads masks on several devices
        if key not in self._cache:
            inputs = self.inputs.get(stack, StackInputs())
            self._cache[key] = inputs.meta(batch, length, device, self.special_ids)
        return self._cache[key]

    def clear(self) -> None:
        self.inputs, self._cache = {}, {}
