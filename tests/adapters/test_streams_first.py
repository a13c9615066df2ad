"""Gemma 3n's AltUp residual is (n, B, T, d), its streams first: residual sites are the
(B, T, n, d) permutation, read and edited as a plain hook on the model's tensor would."""

from __future__ import annotations

import torch

import conceptlens
from conceptlens.steering import Add
from tests.adapters import coverage
from tests.conftest import Batches


def test_streams_first_residual_sites():
    model, inputs, out = coverage.reference("gemma3n_text")
    lens = conceptlens.attach(model)
    n, d = out.hidden_states[0].shape[0], out.hidden_states[0].shape[-1]
    assert lens.site("blocks.0.resid_out").shape == ("B", "T", n, d)
    assert lens.site("blocks.0.attn_out").shape == ("B", "T", d)  # the sublayers run on one stream
    names = ["embed", "blocks.0.resid_out", "blocks.1.resid_in"]
    acts = coverage.capture_all(lens, model, inputs, names)
    assert torch.equal(acts["embed"], out.hidden_states[0].permute(1, 2, 0, 3))
    assert torch.equal(acts["blocks.0.resid_out"], out.hidden_states[1].permute(1, 2, 0, 3))
    assert torch.equal(acts["blocks.1.resid_in"], acts["blocks.0.resid_out"])
    cap = Batches()
    with lens.capture(["blocks.0.resid_out"], on_batch=cap), torch.no_grad():  # rows: one per token
        model(**inputs)
    assert tuple(cap.acts["blocks.0.resid_out"].shape) == (inputs["input_ids"].numel(), n, d)


def test_streams_first_edit_equals_a_manual_hook():
    model, inputs, _ = coverage.reference("gemma3n_text")
    lens = conceptlens.attach(model)
    site = lens.site("blocks.0.resid_out")
    n, d = site.shape[2], site.shape[3]
    vector = torch.randn(n * d, generator=torch.Generator().manual_seed(0))
    with lens.steer(Add(vector, 1.5, site=site.name)), torch.no_grad():
        steered = model(**inputs).logits
    with lens.steer(Add(vector, 0.0, site=site.name)), torch.no_grad():
        null = model(**inputs).logits
    handle = site.module.register_forward_hook(lambda m, a, o: o + 1.5 * vector.view(n, 1, 1, d))
    try:
        with torch.no_grad():
            manual = model(**inputs).logits
    finally:
        handle.remove()
    with torch.no_grad():
        plain = model(**inputs).logits
    assert torch.equal(steered, manual) and torch.equal(null, plain)
