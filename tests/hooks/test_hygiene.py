"""No hook outlives its scope: exceptions at every stage leave the model as it was."""

from __future__ import annotations

import pytest
import torch

import conceptlens
from conceptlens.hooks import attention, capture
from tests.conftest import Batches, hook_snapshot, tiny_inputs, tiny_model

SITES = ["embed", "blocks.0.resid_in", "blocks.0.attn.q", "blocks.1.attn.k", "blocks.1.attn_out",
         "blocks.1.mlp_out", "blocks.1.resid_out", "final"]


class Boom(Exception):
    pass


@pytest.fixture
def setup():
    model = tiny_model("llama")
    inputs = tiny_inputs("llama")
    with torch.no_grad():
        bare = model(**inputs).logits
    return model, conceptlens.attach(model), inputs, bare, hook_snapshot(model)


def _assert_clean(lens, model, inputs, bare, snapshot):
    assert hook_snapshot(model) == snapshot
    assert attention.active_hook_count(lens.hooks) == 0
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, bare)


def test_exception_inside_with(setup):
    model, lens, inputs, bare, snap = setup
    with pytest.raises(Boom), lens.capture(SITES):
        assert hook_snapshot(model) != snap
        raise Boom
    _assert_clean(lens, model, inputs, bare, snap)


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_exception_inside_on_batch(setup, error):
    model, lens, inputs, bare, snap = setup

    def on_batch(acts, meta):
        raise error

    with pytest.raises(error), lens.capture(SITES, on_batch=on_batch), torch.no_grad():
        model(**inputs)
    _assert_clean(lens, model, inputs, bare, snap)


@pytest.mark.parametrize("fail_at", [0, 2, 5, len(SITES) - 1])
def test_exception_during_registration(setup, monkeypatch, fail_at):
    model, lens, inputs, bare, snap = setup
    real, calls = capture.hook_site, []

    def flaky(hooks, site, fn):
        calls.append(site.name)
        if len(calls) == fail_at + 1:
            raise Boom(f"registration of {site.name}")
        return real(hooks, site, fn)

    monkeypatch.setattr(capture, "hook_site", flaky)
    with pytest.raises(Boom), lens.capture(SITES):
        pass
    _assert_clean(lens, model, inputs, bare, snap)


def test_exception_inside_a_hooked_forward(setup):
    model, lens, inputs, bare, snap = setup

    def explode(module, args, output):
        raise Boom

    handle = model.model.layers[1].register_forward_hook(explode)  # fails mid-forward, after sites fired
    snap_with = hook_snapshot(model)
    try:
        with pytest.raises(Boom), lens.capture(SITES), torch.no_grad():
            model(**inputs)
        assert hook_snapshot(model) == snap_with
    finally:
        handle.remove()
    _assert_clean(lens, model, inputs, bare, snap)


def test_interrupt_in_a_capture_only_forward(setup):
    model, lens, inputs, bare, snap = setup

    def on_batch(acts, meta):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt), lens.capture(["blocks.0.resid_out"], on_batch=on_batch) as cap:
        cap.forward(**inputs)
    _assert_clean(lens, model, inputs, bare, snap)


def test_nested_and_repeated_captures(setup):
    model, lens, inputs, bare, snap = setup
    outer, inner = Batches(), Batches()
    with torch.no_grad(), lens.capture(["blocks.0.resid_out", "blocks.1.attn.k"], on_batch=outer):
        with lens.capture(["blocks.0.resid_out", "blocks.1.attn.q"], on_batch=inner):
            logits = model(**inputs).logits
        assert torch.equal(logits, bare)
        assert torch.equal(outer.acts["blocks.0.resid_out"], inner.acts["blocks.0.resid_out"])
        assert attention.active_hook_count(lens.hooks) == 1  # inner's q hook is gone, outer's k hook stays
    for _ in range(3):
        seen = Batches()
        with torch.no_grad(), lens.capture(SITES, on_batch=seen):
            model(**inputs)
        assert len(seen) == 1 and set(seen.acts) == set(SITES)
    _assert_clean(lens, model, inputs, bare, snap)


def test_capture_cannot_be_entered_twice(setup):
    model, lens, inputs, bare, snap = setup
    cap = lens.capture(["blocks.0.resid_out"])
    with cap, pytest.raises(RuntimeError, match="already active"), cap:
        pass
    _assert_clean(lens, model, inputs, bare, snap)


def test_attention_registry_restored_with_a_preexisting_entry(setup):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model, lens, inputs, bare, snap = setup
    marker = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = marker  # a user's own local override
    try:
        with lens.capture(["blocks.0.attn.q"]), torch.no_grad():
            assert ALL_ATTENTION_FUNCTIONS._local_mapping["sdpa"] is not marker
            model(**inputs)
        assert ALL_ATTENTION_FUNCTIONS._local_mapping["sdpa"] is marker
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]
    _assert_clean(lens, model, inputs, bare, snap)
