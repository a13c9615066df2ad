"""Views that need hooks of their own or state per hook (see views.py for the protocol).

Each overrides `attach`: it asks `hooks` (sites.views.ViewHooks) for what it needs, wraps the
callback, and registers it through `register`; everything it registered goes with the handle.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from conceptlens.sites.views import Register, Removable, SiteFn, Target, View, ViewHooks


def spread(out: Tensor, weights: Tensor, flat: bool = True) -> Tensor:
    """A sublayer output (..., d) written to n streams with weights (..., n): (..., n * d), or
    (..., n, d) where the residual keeps its streams in a dimension of their own (HY-V4)."""
    both = out.unsqueeze(-2) * weights.unsqueeze(-1)
    return both.flatten(-2) if flat else both


class Expansion(View):
    """How a sublayer's output of width d enters a residual of n streams (width n * d), as in
    hyper-connections: the site is `(out[..., None, :] * w[..., :, None]).flatten(-2)`, w the
    (B, T, n) per-stream weights a gate module of the block returns (element `index` of its
    output); without the flatten where the residual is (B, T, n, d) (`flat` False). The residual
    with it added is read by `receiver`: at its input, which it passes on ("input"), at its input
    and again by the block, which adds it to its output ("both"), or it is the block's output
    ("output", `receiver` is the block). An edit's change is added there (hooks/hyper.py)."""

    def __init__(self, gate: nn.Module, index: int, receiver: nn.Module, point: Literal["input", "output", "both"],
                 flat: bool = True, block: nn.Module | None = None) -> None:
        self.gate, self.index, self.receiver = gate, index, receiver
        self.point, self.flat, self.block = point, flat, block

    def attach(self, hooks: ViewHooks, site: Target, fn: SiteFn, register: Register) -> Removable:
        state = hooks.streams(site.module, self)

        def call(x: Tensor) -> None:
            seen = state.site_tensor(x)
            new = fn(seen)
            if new is not None:
                state.add(new - seen)

        return hooks.group(lambda: state, lambda: register(call))

    def __repr__(self) -> str:
        return f"Expansion({type(self.gate).__name__}[{self.index}] -> {self.point} of {type(self.receiver).__name__})"


class FlatRows(View):
    """The module sees `(B * T, d)` rows: its output is viewed as `(B, T, d)`, (B, T) being the
    leading dimensions of `block`'s input in the same call."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block

    def attach(self, hooks: ViewHooks, site: Target, fn: SiteFn, register: Register) -> Removable:
        batch_shape: list[torch.Size] = []

        def remember(module, args, kwargs) -> None:
            x = args[0] if args else kwargs["hidden_states"]
            batch_shape[:] = [x.shape[:-1]]

        def call(x: Tensor) -> Tensor | None:
            new = fn(x.view(*batch_shape[0], -1))
            return None if new is None else new.reshape(x.shape)

        return hooks.group(lambda: hooks.pre_hook(self.block, remember, with_kwargs=True, prepend=True),
                           lambda: register(call))

    def __repr__(self) -> str:
        return f"FlatRows({type(self.block).__name__})"


class Plus(View):
    """The site is the module's output plus these modules' (run beside it on the same input, e.g.
    a shared expert next to the routed ones, or the block's other sublayers of that kind, run
    before it); an edit's change goes to the module's output (a null edit changes nothing)."""

    def __init__(self, others: tuple[nn.Module, ...]) -> None:
        self.others = others

    def attach(self, hooks: ViewHooks, site: Target, fn: SiteFn, register: Register) -> Removable:
        seen: dict[int, Tensor] = {}

        def remember(index: int):
            def hook(module, args, output) -> None:
                seen[index] = output[0] if isinstance(output, (tuple, list)) else output

            return hook

        def call(x: Tensor) -> Tensor | None:
            missing = [m for i, m in enumerate(self.others) if i not in seen]
            if missing:  # `plus` finishes after `module`: the sum is formed at its output instead
                raise RuntimeError(f"{site.name}: {type(missing[0]).__name__} did not run before "
                                   f"{type(site.module).__name__}")
            total = x
            for i in range(len(self.others)):
                total = total + seen.pop(i)
            new = fn(total)
            return None if new is None else x + (new - total)

        steps = [lambda i=i, other=other: hooks.forward_hook(other, remember(i), prepend=True)
                 for i, other in enumerate(self.others)]
        return hooks.group(*steps, lambda: register(call))

    def __repr__(self) -> str:
        return f"Plus({', '.join(type(m).__name__ for m in self.others)})"


class CallOf(View):
    """The site is read and edited only during the `call`-th call (from 0) of `block` in each
    forward of `stack`: one call of a layer the stack runs several times (ALBERT's shared layer, a
    looped layer), or of a module inside a sublayer (adapters/inner.py)."""

    def __init__(self, block: nn.Module, stack: nn.Module, call: int, note: str = "") -> None:
        self.block, self.stack, self.call, self.note = block, stack, call, note

    def attach(self, hooks: ViewHooks, site: Target, fn: SiteFn, register: Register) -> Removable:
        return hooks.gated(self.block, self.stack, self.call, fn, register)

    def describe(self) -> str:
        return self.note

    def __repr__(self) -> str:
        return f"CallOf({type(self.block).__name__}, {self.call})"


class Routed(View):
    """The stack calls `module.forward` directly (SqueezeBERT): while hooked, such calls go
    through its hooks (hooks/routed.py)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def attach(self, hooks: ViewHooks, site: Target, fn: SiteFn, register: Register) -> Removable:
        return hooks.group(lambda: hooks.routed(self.module), lambda: register(fn))

    def describe(self) -> str:
        return f"the stack calls {type(self.module).__name__}.forward directly, so while hooked such calls go " \
            "through its hooks"

    def __repr__(self) -> str:
        return f"Routed({type(self.module).__name__})"


def _record_length(lengths: list[int]):
    def hook(module, args, kwargs) -> None:
        x = kwargs.get("input_ids")
        x = x if x is not None else kwargs.get("inputs_embeds")
        x = x if x is not None or not args else args[0]
        lengths[:] = [int(x.shape[1])] if isinstance(x, Tensor) and x.ndim >= 2 else []

    return hook


class Trim(View):
    """The module sees more positions than this forward's T tokens (T: the length of this
    forward's input to `stack`): padding the model adds (Longformer; the site is the first T),
    positions it prepends (CPM-Ant's prompt, `last`: the last T), or `offset` rows of padding on
    both sides (PEGASUS-X's staggered attention: the T after them; with no `stack`, T is the rest
    less as much padding behind). An edit leaves the other positions as they were."""

    def __init__(self, stack: nn.Module | None, last: bool = False, offset: int = 0) -> None:
        self.stack, self.last, self.offset = stack, last, offset

    def attach(self, hooks: ViewHooks, site: Target, fn: SiteFn, register: Register) -> Removable:
        lengths: list[int] = []
        last, offset = self.last, self.offset

        def call(x: Tensor) -> Tensor | None:
            length = lengths[0] if lengths else x.shape[1] - 2 * offset
            if x.shape[1] <= length and not offset:
                return fn(x)
            start = x.shape[1] - length if last else offset
            new = fn(x[:, start:start + length])
            if new is None:
                return None
            return torch.cat([x[:, :start], new.to(x.dtype), x[:, start + length:]], dim=1)

        steps = [] if self.stack is None else \
            [lambda: hooks.pre_hook(self.stack, _record_length(lengths), with_kwargs=True)]
        return hooks.group(*steps, lambda: register(call))

    def describe(self) -> str:
        notes = []
        if self.stack is not None and self.last:
            notes.append("the module also runs on positions the model prepends (prompt tokens): the site is the "
                         "last T, edits leave the rest")
        elif self.stack is not None:
            notes.append("the module runs on more positions than this forward's tokens (padding to an attention "
                         "window, or n-gram streams after the main one): the site is the first T, edits leave the rest")
        if self.offset:
            notes.append(f"the module runs on the block's rows with {self.offset} padding rows on both sides: the site "
                         f"starts {self.offset} rows in")
        return "; ".join(notes)

    def __repr__(self) -> str:
        where = "last" if self.last else "first"
        return f"Trim({where}{f', offset={self.offset}' if self.offset else ''})"


class FirstCall(View):
    """The module runs more than once per call of `block` (PEGASUS-X's FFN: on the tokens, then on
    its global tokens): the site is its first call in each call of the block."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block

    def attach(self, hooks: ViewHooks, site: Target, fn: SiteFn, register: Register) -> Removable:
        return hooks.gated(site.module, self.block, 0, fn, register)

    def describe(self) -> str:
        return "the block runs it more than once per call: the site is its first call in each"

    def __repr__(self) -> str:
        return f"FirstCall({type(self.block).__name__})"


class SplitKeys(View):
    """The module's attention calls attend to this forward's tokens' keys followed by others
    (adapters/keys.py): "stack" (then the other stack's tokens, T5Gemma2's merged attention; a k/v
    site whose shape[1] is "S" is that part) or "appended" (entries a submodule returns)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def attach(self, hooks: ViewHooks, site: Target, fn: SiteFn, register: Register) -> Removable:
        return hooks.group(lambda: hooks.key_layout(site.module, self.kind), lambda: register(fn))

    def __repr__(self) -> str:
        return f"SplitKeys({self.kind!r})"

