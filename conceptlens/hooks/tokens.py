"""Token bookkeeping: which rows of a forward are real tokens, and where they sit.

A pre-hook on each stack module (the base model, or its encoder / decoder) records that
stack's inputs; `StackInputs.meta(T)` turns them into a per-token keep mask, absolute
positions (through left padding and the KV cache) and token ids for a tensor of length T.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
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
    carried: Tensor | None = None
    """(B,) position of each row's next token, carried from the stack's previous forward when this
    one continues its cache and has a 4-D mask (set by `TokenTracker`): a sliding-window layer's
    mask shows only the window, not the left padding before it."""
    mask4: Tensor | None = field(init=False)
    """transformers' 4-D mask as bool (True: attended), or None. Of its mapping per layer type,
    which `generate` passes with a static cache, the full-attention one when there is one."""

    def __post_init__(self) -> None:
        mask = self.attention_mask
        if isinstance(mask, dict):
            mask = mask.get("full_attention", next(iter(mask.values()), None))
        if isinstance(mask, Tensor) and mask.ndim == 4:
            self.mask4 = mask if mask.dtype == torch.bool else mask == 0  # additive masks: 0 where attended
        else:
            self.mask4 = None

    def past_length(self, length: int) -> int:
        past = self.past
        return int(past[-1]) + 1 - length if isinstance(past, Tensor) else past

    def _own_keys(self, mask: Tensor) -> Tensor:
        """(B, T): whether each of this forward's T tokens attends its own key. transformers masks
        every key of a padding query (and no query's own key otherwise), so this is the padding
        mask of this forward's tokens whatever window the layer has. Their keys are the mask's
        last T of the first `past + T` columns (a static cache has more), or its last T columns
        when it shows a sliding window shorter than that."""
        t = mask.shape[2]
        end = min(mask.shape[-1], self.past_length(t) + t)
        i = torch.arange(t, device=mask.device)
        return mask[:, 0, i, end - t + i]

    def key_mask(self) -> Tensor | None:
        """(B, S) mask of real tokens, cached ones included, or None where it cannot be told.

        A 2-D mask is taken as given. Of a 4-D mask, a first forward's tokens are those that
        attend their own key (`_own_keys`: a sliding window hides earlier tokens from the last
        query); with a cache, the keys the last query may attend among the first `past + T`
        (left padding is the only masked key there unless a window hides it: `carried`).
        """
        mask = self.mask4
        if mask is None:
            mask = self.attention_mask
            return mask if isinstance(mask, Tensor) and mask.ndim == 2 else None
        t = mask.shape[2]
        past = self.past_length(t)
        return self._own_keys(mask) if past == 0 else mask[:, 0, -1, :past + t]

    def real_tokens(self) -> Tensor | None:
        """(B,) real tokens of each row up to the end of this forward, cached ones included: the
        position the row's next token takes, 0 for a row of padding so far (None where it cannot
        be told). A few small reductions (~10 us on a CPU): `TokenTracker` carries it into every
        forward with a 4-D mask, whether or not that forward's bookkeeping is read."""
        mask4 = self.mask4
        if mask4 is not None and self.carried is not None:
            return self.carried + self._own_keys(mask4).sum(-1).to(self.carried.device)
        mask = self.key_mask()
        return None if mask is None else mask.sum(-1)

    def batch(self) -> int | None:
        """Rows in this forward (its ids', else its mask's)."""
        if isinstance(self.input_ids, Tensor) and self.input_ids.ndim == 2:
            return self.input_ids.shape[0]
        mask = self.mask4
        if mask is None:
            mask = self.attention_mask if isinstance(self.attention_mask, Tensor) else None
        return None if mask is None else mask.shape[0]

    def length(self) -> int | None:
        """Tokens in this forward (its ids', else its 4-D mask's queries)."""
        if isinstance(self.input_ids, Tensor) and self.input_ids.ndim == 2:
            return self.input_ids.shape[1]
        mask = self.mask4
        return None if mask is None else mask.shape[2]

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
        mask4 = self.mask4
        carried = self.carried
        if mask4 is not None and carried is not None and carried.shape[0] == batch and mask4.shape[2] == length:
            keep = self._own_keys(mask4).to(device)
            position = carried.to(device)[:, None] + (keep.long().cumsum(-1) - 1).clamp(min=0)
            return self._with_tokens(batch, length, device, keep, position, special_ids)
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
        return self._with_tokens(batch, length, device, keep, position, special_ids)

    def _with_tokens(self, batch: int, length: int, device: torch.device, keep: Tensor, position: Tensor,
                     special_ids: Tensor | None) -> TokenMeta:
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
            inputs, before = recorder(args, kwargs), self.inputs.get(name)
            if before is not None and inputs.mask4 is not None:
                inputs.carried = _carried(before, inputs)
            self.inputs[name] = inputs
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


def _carried(before: StackInputs, now: StackInputs) -> Tensor | None:
    """`now.carried`: the positions after `before`'s tokens, when `now` continues `before`'s cache
    (its past is `before`'s past plus its tokens) in as many rows; else None."""
    mask, length = now.mask4, now.length()
    before_length, before_batch = before.length(), before.batch()
    if mask is None or length is None or before_length is None or before_batch != mask.shape[0]:
        return None
    past = now.past_length(length)
    if past == 0 or past != before.past_length(before_length) + before_length:
        return None
    return before.real_tokens()
