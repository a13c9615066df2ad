"""route_through_call: a module whose parent calls `module.forward(...)` directly runs its hooks
while routed, a normal call runs them once, and the instance is restored exactly."""

from __future__ import annotations

import torch
from torch import nn

from conceptlens.hooks.routed import route_through_call
from conceptlens.hooks.manager import HookManager
from conceptlens.sites.views import ChannelsFirst, Heads


class _Direct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return self.inner.forward(x)  # skips inner's hooks, as SqueezeBERT's encoder does


def _counting(module, calls):
    return module.register_forward_hook(lambda m, a, o: calls.append(1))


def test_direct_calls_run_hooks_only_while_routed_and_normal_calls_once():
    model, calls, x = _Direct(), [], torch.randn(2, 4)
    hook = _counting(model.inner, calls)
    model(x)
    assert calls == []  # the direct call skips the hook
    hooks = HookManager(model)
    with route_through_call(hooks, model.inner), route_through_call(hooks, model.inner):  # reference counted
        model(x)
        model.inner(x)  # a normal call: hooks once, not twice
        assert len(calls) == 2
    model(x)
    assert len(calls) == 2 and "forward" not in model.inner.__dict__
    assert not model.inner._forward_pre_hooks and list(model.inner._forward_hooks) == [hook.id]
    hook.remove()


def test_an_instance_forward_set_by_someone_else_is_kept_and_called():
    model, seen, x = _Direct(), [], torch.randn(2, 4)
    original = model.inner.forward
    model.inner.forward = lambda y: seen.append(1) or original(y)  # e.g. accelerate's wrapper
    wrapper = model.inner.forward
    calls = []
    _counting(model.inner, calls)
    with route_through_call(HookManager(model), model.inner):
        model(x)
    assert calls == [1] and seen == [1] and model.inner.forward is wrapper


def _through(views, fn):
    for view in reversed(views):  # the first view is nearest the module, as hook_site composes them
        fn = view.wrap(fn)
    return fn


def test_channels_first_hands_b_t_c_and_puts_edits_back():
    x = torch.arange(2 * 8 * 3, dtype=torch.float32).view(2, 8, 3)  # (B, C, T)
    got = {}
    read = _through((ChannelsFirst(), Heads(2)), lambda y: got.update(y=y))
    assert read(x) is None and torch.equal(got["y"], x.transpose(1, 2).unflatten(-1, (2, 4)))
    both = _through((ChannelsFirst(), Heads(2)), lambda y: y + 1)(x)
    assert both.is_contiguous() and torch.equal(both, x + 1)
    edit = _through((ChannelsFirst(),), lambda y: y + 1)
    out = edit(x)
    assert out.is_contiguous() and torch.equal(out, x + 1)
