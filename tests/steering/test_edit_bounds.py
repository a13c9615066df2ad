"""Steering strengths checked in the dtype the edit is applied in, not in float64."""

from __future__ import annotations

import torch

import conceptlens
from conceptlens.steering import Add
from tests.conftest import CharTokenizer, tiny_model
from tests.faults import one_line_error

SITE = "blocks.1.resid_out"


def test_an_alpha_past_float32_is_refused_when_built():
    v = torch.ones(32)
    one_line_error(ValueError, lambda: Add(v, alpha=1e39, site=SITE), "alpha=1e+39", "overflows float32")
    Add(v, alpha=3e38 / 32**0.5, scale="unit", site=SITE)  # the largest unit step float32 holds is accepted


def test_an_alpha_past_the_models_dtype_is_refused_when_the_scope_is_built():
    lens = conceptlens.attach(tiny_model("llama").to(torch.float16), CharTokenizer())
    edit = Add(torch.ones(32), alpha=1e6, scale="unit", site=SITE)  # entries 1e6 / sqrt(32): finite in float32
    one_line_error(ValueError, lambda: lens.steer(edit).__enter__(), "alpha=1e+06", "overflows float16", "6.55e+04")
    ok = Add(torch.ones(32), alpha=1.0, scale="unit", site=SITE)
    with lens.steer(ok):
        pass
