"""A stack's block view is found from block 0's input against HF's hidden_states[0], and
`as_hidden` maps a block tensor back to HF's layout: both checked on each kind of view."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conceptlens.adapters.block_view import BlockView, as_hidden, block_view, resid_shape
from conceptlens.adapters.probe_pass import Trace
from conceptlens.adapters.repeated import projection_view

B, T, D = 2, 5, 8


def _hidden() -> torch.Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(0))


def _prefix() -> torch.Tensor:
    return torch.randn(B, 3, D, generator=torch.Generator().manual_seed(1))


# how block 0's input holds HF's (B, T, d) hidden_states[0], and the view that says so
CASES = {
    "plain": (lambda h: h.clone(), BlockView()),
    "time-major (FSMT)": (lambda h: h.transpose(0, 1).clone(), BlockView(time_major=True)),
    "channels-first (SqueezeBERT)": (lambda h: h.transpose(1, 2).clone(), BlockView(channels_first=True)),
    "positions after (Longformer)": (lambda h: torch.cat([h, _prefix()], 1), BlockView(added="after")),
    "positions before (CPM-Ant)": (lambda h: torch.cat([_prefix(), h], 1), BlockView(added="before")),
}


@pytest.mark.parametrize("case", CASES)
def test_the_view_is_found_and_as_hidden_gives_hf_layout_back(case):
    make, expected = CASES[case]
    block, h = nn.Identity(), _hidden()
    x = make(h)
    view = block_view(block, Trace(inputs={block: x}), (h,))
    assert view == expected
    assert torch.equal(as_hidden(x, view, T), h)


def test_streams_first_residual_gives_batch_first_sites():
    block, h = nn.Identity(), torch.randn(4, 1, T, D)  # (n, B, T, d) on the probe's one row
    view = block_view(block, Trace(inputs={block: h.clone()}), (h,))
    assert view == BlockView(streams_first=True)
    assert as_hidden(h, view, T) is h
    assert resid_shape(h, view) == ("B", "T", 4, D)


def test_a_projection_on_the_transposed_rows_is_time_major_and_keeps_the_added_positions():
    """Longformer's q/k/v projections run on the (T', B, d) transpose of its padded rows."""
    block, proj = nn.Identity(), nn.Identity()
    x = torch.randn(B, T + 3, D)
    trace = Trace(inputs={block: x}, outputs={proj: x.transpose(0, 1)})
    padded = BlockView(added="after")
    assert projection_view(padded, block, proj, trace) == BlockView(time_major=True, added="after")
    assert projection_view(BlockView(time_major=True), block, proj, trace) == BlockView()
    trace.outputs[proj] = x[:, :, :4]  # the block's own rows: the block's view
    assert projection_view(padded, block, proj, trace) is padded
    trace.outputs[proj] = x.reshape(T + 3, B, D)[:4]  # neither: no q/k/v site
    assert projection_view(padded, block, proj, trace) is None


def test_views_are_values():
    assert BlockView(added="after").transposed().transposed() == BlockView(added="after")
    with pytest.raises(AttributeError):
        BlockView().time_major = True  # type: ignore[misc]
