"""Hooks for a sublayer output spread over several residual streams (`Site.expand`).

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

from typing import Callable

from torch import Tensor, nn

from conceptlens.hooks.handles import Handle, HandleGroup
from conceptlens.sites.site import Expansion, Site, spread

SiteFn = Callable[[Tensor], Tensor | None]


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


class _Writes:
    """Per (sublayer, expansion): this call's weights and the change edits made to the site."""

    def __init__(self, module: nn.Module, exp: Expansion) -> None:
        self.exp, self.weights, self.pending, self.refs = exp, None, None, 0
        self.handles = HandleGroup()
        self.front, self.block = None, exp.block if exp.block is not None else exp.receiver
        try:
            self.handles.add(exp.gate.register_forward_hook(self._gate, prepend=True))
            self.handles.add(module.register_forward_pre_hook(self._start))
            if exp.point in ("input", "both"):
                self.handles.add(exp.receiver.register_forward_pre_hook(self._to_input, with_kwargs=True,
                                                                        prepend=True))
            if exp.point in ("output", "both"):
                handle = self.block.register_forward_hook(self._to_output, prepend=True)
                self.handles.add(handle)
                self.front = handle.id
        except BaseException:
            self.handles.remove()
            raise

    def _gate(self, module, args, output) -> None:
        self.weights = output[self.exp.index]

    def _start(self, module, args) -> None:
        self.pending = None
        if self.front is not None and self.front in self.block._forward_hooks:
            self.block._forward_hooks.move_to_end(self.front, last=False)  # before resid_out's hooks

    def site_tensor(self, out: Tensor) -> Tensor:
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


_states: dict[tuple[nn.Module, nn.Module, nn.Module], _Writes] = {}


def stream_hook(site: Site, fn: SiteFn, edit: bool = False) -> Handle:
    """Register `fn` at a site whose tensor is its module's output spread over the streams."""
    key = (site.module, site.expand.gate, site.expand.receiver)
    state = _states.get(key)
    if state is None:
        state = _states[key] = _Writes(site.module, site.expand)
    state.refs += 1

    def release() -> None:
        state.refs -= 1
        if state.refs == 0 and _states.get(key) is state:
            _states.pop(key).handles.remove()

    def hook(module, args, output) -> None:
        seen = state.site_tensor(_first(output))
        new = fn(seen)
        if new is not None:
            state.add(new - seen)

    group = HandleGroup()
    group.add(Handle(release))
    try:
        group.add(site.module.register_forward_hook(hook, prepend=edit))
    except BaseException:
        group.remove()
        raise
    return group
