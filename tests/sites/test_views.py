"""Sites as composed views: a Site is its module's tensor seen through an ordered tuple of views,
each an idiom that reads, writes back and describes itself; `hook_site` composes them."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from conceptlens.adapters.readings import Readings, site_views
from conceptlens.hooks.manager import HookManager
from conceptlens.hooks.points import hook_site
from conceptlens.sites.hooked_views import CallOf, FirstCall, Plus, Routed, Trim
from conceptlens.sites.site import Site
from conceptlens.sites.views import ChannelsFirst, Heads, Scale, StreamsFirst, TimeMajor, View


def test_a_site_keeps_no_quirk_fields_only_its_views():
    assert [f.name for f in dataclasses.fields(Site)] == ["name", "module", "point", "shape", "stack", "source",
                                                          "views"]


def _linear_site(*views: View) -> tuple[nn.Linear, Site]:
    torch.manual_seed(0)
    proj = nn.Linear(4, 6)
    return proj, Site("blocks.0.attn.q_pre", proj, "output", ("B", "T", 2, 3), "", "a projection", views)


def test_hook_site_reads_through_the_views_in_order_and_writes_an_edit_back():
    proj, site = _linear_site(Heads(2), Scale(0.5))
    x = torch.randn(2, 5, 4)
    seen = []
    hooks = HookManager(proj)
    with hook_site(hooks, site, seen.append):
        plain = proj(x)
    assert torch.equal(seen[0], plain.unflatten(-1, (2, 3)) * 0.5)  # heads first, then the scale
    with hook_site(hooks, site, lambda y: y + 1.0, edit=True):
        edited = proj(x)
    assert torch.allclose(edited, plain + 2.0, atol=1e-6)  # +1 on the scaled site is +2 on the output
    with hook_site(hooks, site, lambda y: y.clone(), edit=True):
        assert torch.equal(proj(x), plain)  # a null edit is bit for bit
    assert not hooks.attached()
    assert "views=(Heads(2), Scale(0.5))" in repr(site)


class Negated(View):
    """A view written outside the package: the site is minus the module's tensor."""

    def read(self, x):
        return -x

    def write(self, x, new):
        return -new

    def describe(self) -> str:
        return "negated"


def test_a_new_idiom_is_one_small_view_class():
    proj, site = _linear_site(Negated(), Heads(2))
    x = torch.randn(2, 5, 4)
    hooks = HookManager(proj)
    plain = proj(x)
    seen = []
    with hook_site(hooks, site, seen.append):
        proj(x)
    with hook_site(hooks, site, lambda y: y * 0 + 1.0, edit=True):
        edited = proj(x)
    assert torch.equal(seen[0], -plain.unflatten(-1, (2, 3)))
    assert torch.equal(edited, -torch.ones_like(plain))


def test_the_views_come_in_the_order_hook_site_always_applied_the_idioms():
    block, stack = nn.Linear(2, 2), nn.Linear(2, 2)
    r = Readings(heads=2, plus=block, scale=0.5, call=CallOf(block, stack, 1), streams_first=True, time_major=True,
                 routed=block, trim=Trim(stack), first_call_in=block)
    kinds = [type(v) for v in site_views("output", r)]
    assert kinds == [Heads, Plus, Scale, CallOf, StreamsFirst, TimeMajor, Routed, Trim, FirstCall]
    kinds = [type(v) for v in site_views("output", dataclasses.replace(r, channels_first=True, plus=None))]
    assert kinds == [Scale, CallOf, StreamsFirst, TimeMajor, ChannelsFirst, Heads, Routed, Trim, FirstCall]
    assert [type(v) for v in site_views("k", r)] == kinds[:4] + [Routed, Trim, FirstCall]
