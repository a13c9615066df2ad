"""Steering scopes: edits applied at their sites while a `with` block runs.

    with lens.steer(Add(cs[12], alpha=6.0), positions="generated"):
        model.generate(**inputs)

Each site with active edits has exactly one hook (kept by the model's HookManager, whose scope
stack adds and removes only the hooks of sites a scope is first or last to edit), which applies
that site's edits in the order they were entered; consecutive `Add`s with the same positions are
summed into one vector first (so Add(a) with Add(-a) changes nothing, bit for bit: in one scope,
or across nested scopes whose positions are "all" or the same slice; two nested "prompt" or
"generated" scopes each take their own first forward as the prompt, so their Adds are applied
one after the other). Positions are absolute — counted among a sequence's real tokens, through
left padding and the KV cache — so an edit gives the same tokens with and without `use_cache`.
`"prompt"` is the tokens of the first forward inside the scope; `"generated"` all later ones. A
chunked prefill (`generate(prefill_chunk_size=...)`) runs the prompt in several forwards, which the
forwards' arguments do not tell from decoding steps: the scope warns, and slices of absolute
positions say which tokens are the prompt.
"""

from __future__ import annotations

import copy
import math
import warnings
from numbers import Integral
from typing import Literal, Sequence

import torch
from torch import Tensor

from conceptlens.hooks.tokens import StackInputs, TokenMeta, TokenTracker
from conceptlens.interface import AttachedModel
from conceptlens.steering.edits import Add, Edit, add_vector
from conceptlens.steering.noops import warn_if_no_effect

Positions = Literal["all", "prompt", "generated"] | slice
_NAMED = ("all", "prompt", "generated")


class Steer:
    """One `lens.steer(...)` scope: its edits, positions and prompt bookkeeping."""

    def __init__(self, lens: AttachedModel, edits: Sequence[Edit], positions: Positions = "all") -> None:
        if not edits:
            raise ValueError("steer needs at least one edit, e.g. Add(concepts, alpha=4.0)")
        for edit in edits:
            if not isinstance(edit, Edit):
                what = f"a tensor of shape {tuple(edit.shape)}" if isinstance(edit, Tensor) else _short(edit)
                raise TypeError(f"not an edit: {what}; wrap it in Add(v, alpha), ProjectOut, Clamp or CodeAblate")
        if isinstance(positions, slice):
            if positions.step not in (None, 1):
                raise ValueError(f"positions slice must have step 1; got {positions}")
            for bound in (positions.start, positions.stop):
                if bound is not None and (not isinstance(bound, Integral) or isinstance(bound, bool) or bound < 0):
                    raise ValueError(f"positions slice bounds must be absolute token positions (ints >= 0, or None); "
                                     f"got {positions}: a negative bound does not count from the end here")
        elif positions not in _NAMED:
            raise ValueError(f"positions must be one of {_NAMED} or a slice of absolute positions; got {positions!r}")
        self.lens = lens
        self.sites = [lens.site(edit.site) for edit in edits]  # fails before any hook is added
        for site in self.sites:
            if site.point == "pattern":
                raise ValueError(f"{site.name} is read only (attention probabilities); edit attn.q or attn.k instead")
        for edit, site in zip(edits, self.sites):
            edit.check(site.name, math.prod(int(s) for s in site.shape[2:]), lens.name)
        for edit, site in zip(edits, self.sites):
            edit.bind(lens)  # e.g. Add(scale="robust_norm") measures the site's token norm, before any hook
            warn_if_no_effect(lens, site, edit, positions)
        # the scope applies the edits as bound to this lens: a copy each, so binding the same edit to
        # another lens (whose unit differs) later changes nothing here
        self.edits = [copy.copy(edit) for edit in edits]
        self.positions = positions
        self.prompt_length: dict[str, Tensor] = {}  # stack -> (B,) real tokens in the first forward
        self._checked: set[str] = set()  # stacks whose forward after the prompt `_check_prompt_chunks` read
        self._active = False

    def __enter__(self) -> Steer:
        if self._active:
            raise RuntimeError("this steering scope is already active")
        self.prompt_length.clear()  # a scope entered again starts a new prompt
        self._checked.clear()
        self.lens.hooks.steering.enter(self, self.lens.stacks, list(zip(self.sites, self.edits)), _build)
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._active:
            self._active = False
            self.lens.hooks.steering.leave(self)

    def observe(self, stack: str, meta_source: TokenTracker) -> None:
        """Called when a stack's forward starts: the first one defines the prompt."""
        inputs = meta_source.inputs[stack]
        if stack in self.prompt_length:
            self._check_prompt_chunks(stack, inputs)
            return
        mask = inputs.key_mask()
        if mask is not None:
            self.prompt_length[stack] = mask.sum(-1)
        elif inputs.input_ids is not None:
            ids = inputs.input_ids
            self.prompt_length[stack] = torch.full((ids.shape[0],), ids.shape[-1], device=ids.device)

    def _check_prompt_chunks(self, stack: str, inputs: StackInputs) -> None:
        """Warn when the forward after the prompt continues its cache with several tokens:
        `generate(prefill_chunk_size=...)` splits a prompt so, and this scope would count the chunks
        after the first as generated (no argument of the forwards tells a chunk from a decoding step:
        a last chunk of one token looks like one). Read once per prompt and stack."""
        if self.positions not in ("prompt", "generated") or stack in self._checked:
            return
        self._checked.add(stack)
        length = inputs.length()
        if length is not None and length > 1 and inputs.past_length(length) > 0:
            warnings.warn(f"positions={self.positions!r} takes the first forward in the scope as the prompt, but a "
                          f"later forward continued its cache with {length} tokens per row, as a chunked prefill "
                          f"(generate(prefill_chunk_size=...)) does: the prompt's later chunks count as generated "
                          f"here. Generate without prefill_chunk_size, or pass positions=slice(0, L) "
                          f"(\"prompt\") or slice(L, None) (\"generated\") with the prompt's length L",
                          stacklevel=2)

    def mask(self, stack: str, meta: TokenMeta) -> Tensor | None:
        """(B, T) bool mask of positions this scope edits, or None for all."""
        if self.positions == "all":
            return None
        if isinstance(self.positions, slice):
            start = self.positions.start or 0
            stop = self.positions.stop if self.positions.stop is not None else torch.iinfo(torch.long).max
            return (meta.position >= start) & (meta.position < stop)
        length = self.prompt_length.get(stack)
        if length is None:  # a stack whose forward we never saw start: treat as prompt
            in_prompt = torch.ones_like(meta.keep)
        elif length.shape[0] != meta.position.shape[0]:
            raise RuntimeError(f"positions={self.positions!r}: this scope's prompt had {length.shape[0]} rows but "
                               f"this forward has {meta.position.shape[0]}; open one steering scope per generate call")
        else:
            in_prompt = meta.position < length.to(meta.position.device)[:, None]
        return in_prompt if self.positions == "prompt" else ~in_prompt


def _build(site, entries: list[tuple[Steer, Edit]], tracker: TokenTracker):
    """The function of a site's one edit hook: its open scopes' edits, in entry order."""
    groups = _fuse(entries)
    stack = site.stack
    needs_meta = any(scope.positions != "all" for scope, _ in groups)  # bookkeeping costs ~60 us
    moved: dict[tuple, Tensor] = {}

    def edit(x: Tensor) -> Tensor:
        heads = x.shape[2:-1]
        if heads:  # q/k/v (B, T, H, d): edits see concatenated heads
            x = x.flatten(2)
        meta = tracker.meta(stack, x.shape[0], x.shape[1], x.device) if needs_meta else None
        for scope, item in groups:
            mask = scope.mask(stack, meta) if meta is not None else None  # meta: read when a scope needs it
            if isinstance(item, Tensor):
                key = (id(item), x.device, x.dtype)
                if key not in moved:  # one host-to-device copy per scope, not per step
                    moved[key] = item.to(device=x.device, dtype=x.dtype)
                x = add_vector(x, moved[key], mask)
            else:
                x = item.apply(x, mask)
        return x.unflatten(2, (*heads, -1)) if heads else x

    return edit


def _fuse(entries: list[tuple[Steer, Edit]]) -> list[tuple[Steer, Edit | Tensor]]:
    """Sum consecutive Adds of scopes that select the same positions into one vector."""
    groups: list[tuple[Steer, Edit | Tensor]] = []
    for scope, edit in entries:
        if type(edit) is Add and groups and isinstance(groups[-1][1], Tensor) and \
                _same_positions(groups[-1][0], scope):
            groups[-1] = (groups[-1][0], groups[-1][1] + edit.vector)
        else:
            groups.append((scope, edit.vector.clone() if type(edit) is Add else edit))
    return groups


def _same_positions(a: Steer, b: Steer) -> bool:
    if a is b or a.positions == b.positions == "all":
        return True
    return isinstance(a.positions, slice) and a.positions == b.positions


def _short(value: object, limit: int = 80) -> str:
    """`repr(value)` on one line, cut to `limit` characters."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
