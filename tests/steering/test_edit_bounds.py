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


def test_numpy_scalars_are_numbers():
    import numpy as np

    v = torch.ones(32)
    for alpha in (np.float32(0.5), np.float64(0.5), np.int64(2), *np.arange(1, 3)):
        assert Add(v, alpha=alpha, scale="unit", site=SITE).alpha == float(alpha)
    one_line_error(ValueError, lambda: Add(v, alpha=np.float32("nan"), site=SITE), "alpha must be a finite number")


def test_bad_inputs_of_a_scope_are_one_line_naming_the_value():
    from conceptlens.steering import Ablate, ProjectOut

    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    add = Add(torch.ones(32), alpha=1.0, scale="unit", site=SITE)
    one_line_error(TypeError, lambda: lens.steer(torch.randn(4, 32)), "not an edit: a tensor of shape (4, 32)",
                   "Add(v, alpha)")
    for bad in (slice(-2, None), slice(0, -1), slice("a", None), slice(1.5, 3)):
        one_line_error(ValueError, lambda: lens.steer(add, positions=bad), f"got {bad}", "ints >= 0")
    with lens.steer(add, positions=slice(2, None)):  # absolute positions: fine
        pass
    one_line_error(ValueError, lambda: ProjectOut(torch.zeros(0, 32), site=SITE), "at least one nonzero direction")
    one_line_error(ValueError, lambda: ProjectOut(torch.zeros(2, 32), site=SITE), "got 2 directions, none nonzero")
    mean = torch.zeros(32)
    mean[[3, 7]] = torch.tensor([float("nan"), float("inf")])
    one_line_error(ValueError, lambda: Ablate(torch.randn(2, 32), "mean", mean=mean, site=SITE),
                   "mean holds NaN or inf at coordinates [3, 7]")


def test_lens_ablate_takes_the_mean_its_message_asks_for():
    lens = conceptlens.attach(tiny_model("llama"))  # (no tokenizer: the no-op check probes random ids)
    directions = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    one_line_error(ValueError, lambda: lens.ablate(directions, site=SITE, mode="mean"), "mean=")
    mean = torch.randn(32, generator=torch.Generator().manual_seed(1))
    (edit,) = lens.ablate(directions, site=SITE, mode="mean", mean=mean).edits
    torch.testing.assert_close(edit.mean, mean)
    one_line_error(ValueError, lambda: lens.ablate(directions, site=SITE, mean=mean), "mean= is read only by mode='mean'")
