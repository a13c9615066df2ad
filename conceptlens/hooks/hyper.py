"""Hooks for a sublayer output spread over several residual streams (the `Expansion` view).

The site's tensor, `(out[..., None, :] * w[..., :, None]).flatten(-2)`, is formed from the
sublayer's output and the weights its gate returned earlier in the same call, with the same
operations the model uses (so a read is the model's own tensor, bit for bit). An edit cannot be
written back into the narrower output, so its change is added where the residual is next read:
the receiver's input, the block's output (a hook kept in front of the block's other output
hooks, so `resid_out` sees it), or both where the block adds the residual the receiver read to
its output itself (HY-V4). All hooks at one such site share one state per call: a later
hook there sees what earlier edits made of it, and a null edit changes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

from conceptlens.hooks.handles import Handle, HandleGroup
from conceptlens.sites.hooked_views import Expansion, spread

if TYPE_CHECKING:
    from conceptlens.hooks.manager import HookManager


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


class _Writes:
    """Per (sublayer, expansion): this call's weights and the change edits made to the site."""

    def __init__(self, manager: HookManager, module: nn.Module, exp: Expansion) -> None:
        self.manager, self.exp, self.refs = manager, exp, 0
        self.weights: Tensor | None = None
        """The gate's per-stream weights in this call (set by its forward hook)."""
        self.pending: Tensor | None = None
        self.handles = HandleGroup()
        self.front, self.block = None, exp.block if exp.block is not None else exp.receiver
        try:
            self.handles.add(manager.forward_hook(exp.gate, self._gate, prepend=True))
            self.handles.add(manager.pre_hook(module, self._start))
            if exp.point in ("input", "both"):
                self.handles.add(manager.pre_hook(exp.receiver, self._to_input, with_kwargs=True, prepend=True))
            if exp.point in ("output", "both"):
                self.front = self.handles.add(manager.forward_hook(self.block, self._to_output, prepend=True))
        except BaseException:
            self.handles.remove()
            raise

    def _gate(self, module, args, output) -> None:
        self.weights = output[self.exp.index]

    def _start(self, module, args) -> None:
        self.pending = None
        if self.front is not None:
            self.manager.to_front(self.block, self.front)  # before resid_out's hooks

    def site_tensor(self, out: Tensor) -> Tensor:
        if self.weights is None:
            raise RuntimeError(f"the sublayer output spread over the residual streams ran before its gate "
                               f"{type(self.exp.gate).__name__}, which gives the per-stream weights")
        seen = spread(out, self.weights, self.exp.flat)
        return seen if self.pending is None else seen + self.pending

    def add(self, change: Tensor) -> None:
        self.pending = change if self.pending is None else self.pending + change

    def _take(self) -> Tensor | None:
        change, self.pending = self.pending, None
        return change

    def _to_input(self, module, args, kwargs):
        change = self._take() if self.exp.point == "input" else self.pending  # "both": the block adds it again
        if change is None:
            return None
        if args:
            return (args[0] + change.to(args[0].dtype), *args[1:]), kwargs
        x = kwargs["hidden_states"]
        return args, {**kwargs, "hidden_states": x + change.to(x.dtype)}

    def _to_output(self, module, args, output):
        change = self._take()
        if change is None:
            return None
        x = _first(output)
        new = x + change.to(x.dtype)
        if hasattr(output, "_fields"):  # a namedtuple
            return output._replace(**{output._fields[0]: new})
        return type(output)([new, *output[1:]]) if isinstance(output, (tuple, list)) else new


class StreamState(Handle):
    """One hook's share of a (sublayer, expansion)'s state: `site_tensor(out)` and `add(change)`;
    `remove()` gives it up (the state's hooks go with the last share)."""

    def __init__(self, writes: _Writes, release) -> None:
        super().__init__(release)
        self.site_tensor, self.add = writes.site_tensor, writes.add


def stream_state(manager: HookManager, module: nn.Module, expand: Expansion) -> StreamState:
    """The state shared by every hook at `module`'s output spread over the streams by `expand`."""
    key = (id(expand.gate), id(expand.receiver))  # both live while the state holds `expand`
    states = manager.streams.setdefault(module, {})
    state = states.get(key)
    if state is None:
        state = states[key] = _Writes(manager, module, expand)
    state.refs += 1

    def release() -> None:
        state.refs -= 1
        states = manager.streams.get(module, {})
        if state.refs == 0 and states.get(key) is state:
            states.pop(key).handles.remove()
            if not states:
                manager.streams.pop(module, None)

    return StreamState(state, release)
