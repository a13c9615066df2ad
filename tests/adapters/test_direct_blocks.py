"""Blocks whose stack calls `layer.forward(...)` directly, on channels-first tensors (SqueezeBERT):
every site reads the model's real tensor and an edit changes the forward exactly as the same
change made by hand; the block is left exactly as it was when the hooks go."""

from __future__ import annotations

import pytest
import torch

import conceptlens
from conceptlens.steering import Add
from tests.adapters import coverage
from tests.adapters.tiny_configs import build
from tests.conftest import Batches


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


@pytest.fixture(scope="module")
def squeezebert():
    model = build("squeezebert")
    return model, conceptlens.attach(model), coverage.inputs_for(model)


def test_reads_are_the_models_tensors_in_b_t_layout(squeezebert):
    model, lens, inputs = squeezebert
    layer = model.transformer.encoder.layers[0]
    seen = {}
    handles = [layer.post_attention.conv1d.register_forward_hook(lambda m, a, o: seen.update(attn=o)),
               layer.attention.query.register_forward_hook(lambda m, a, o: seen.update(q=o)),
               layer.post_attention.conv1d.register_forward_pre_hook(lambda m, a: seen.update(z=a[0]))]
    out = coverage.forward_with(model, inputs, handles, output_hidden_states=True)
    names = ["embed", "blocks.0.resid_out", "blocks.0.attn_out", "blocks.0.attn.q", "blocks.0.attn.z",
             "blocks.1.resid_out"]
    acts = coverage.capture_all(lens, model, inputs, names)
    assert lens.site("blocks.0.resid_out").shape == ("B", "T", 64)
    assert torch.equal(acts["embed"], out.hidden_states[0])
    assert torch.equal(acts["blocks.0.resid_out"], out.hidden_states[1])
    assert torch.equal(acts["blocks.1.resid_out"], out.hidden_states[2])
    assert torch.equal(acts["blocks.0.attn_out"], seen["attn"].transpose(1, 2))  # (B, C, T) -> (B, T, C)
    q = seen["q"].view(2, 4, 16, 6).permute(0, 3, 1, 2)  # HF's transpose_for_scores, as (B, T, H, d_head)
    assert torch.equal(acts["blocks.0.attn.q"], q)
    z = seen["z"].view(2, 4, 16, 6).permute(0, 3, 1, 2)  # the context before transpose_output merged the heads
    assert torch.equal(acts["blocks.0.attn.z"], z)


def _by_hand(layer, change):
    """Patch the layer's forward the way the encoder calls it; returns the undo."""
    original = layer.forward

    def forward(hidden, mask, output_attentions):
        hidden, out = change(hidden, None)
        out = original(hidden, mask, output_attentions)
        return {**out, "feature_map": change(None, out["feature_map"])[1]}

    layer.forward = forward
    return lambda: layer.__dict__.pop("forward")


@pytest.mark.parametrize("where", ["resid_in", "resid_out"])
def test_block_edits_equal_the_same_change_by_hand(squeezebert, where):
    model, lens, inputs = squeezebert
    layer = model.transformer.encoder.layers[1]
    vector = torch.linspace(-1, 1, 64)
    with lens.steer(Add(vector, 2.0, site=f"blocks.1.{where}"), positions=slice(2, 4)):
        steered = _logits(model, inputs)
    assert "forward" not in layer.__dict__ and not layer._forward_hooks and not layer._forward_pre_hooks

    def change(x, y):  # channels-first: positions are the last dimension
        t = x if where == "resid_in" else y
        if t is not None:
            t = t.clone()
            t[:, :, 2:4] += 2.0 * vector[None, :, None]
        return (t, y) if where == "resid_in" else (x, t)

    undo = _by_hand(layer, change)
    try:
        expected = _logits(model, inputs)
    finally:
        undo()
    assert torch.allclose(steered, expected, atol=1e-6) and not torch.allclose(steered, _logits(model, inputs))


def test_null_edits_are_bit_identical_and_hooks_go_after_an_error(squeezebert):
    model, lens, inputs = squeezebert
    base = _logits(model, inputs)
    vector = torch.linspace(-1, 1, 64)
    edits = [Add(vector, a, site=s) for s in ("blocks.0.resid_out", "blocks.1.attn.z") for a in (1.0, -1.0)]
    with lens.steer(*edits):
        assert torch.equal(_logits(model, inputs), base)
    layer = model.transformer.encoder.layers[0]
    with pytest.raises(RuntimeError, match="boom"), lens.capture(["blocks.0.resid_out"]):
        assert "forward" in layer.__dict__  # routed while hooked
        raise RuntimeError("boom")
    assert "forward" not in layer.__dict__ and not layer._forward_hooks and not layer._forward_pre_hooks


def test_a_stopped_forward_leaves_the_route_working(squeezebert):
    model, lens, inputs = squeezebert
    other = {"input_ids": inputs["input_ids"].flip(-1)}
    with torch.no_grad():
        out = model(**other, output_hidden_states=True)
    seen = Batches()
    with lens.capture(["blocks.0.resid_out"], keep_shape=True, on_batch=seen) as cap, torch.no_grad():
        cap.forward(**inputs)  # stops inside block 0's routed call
        model(**other)  # the next forward still runs block 0's hooks
        assert len(seen) == 2 and torch.equal(seen.acts["blocks.0.resid_out"], out.hidden_states[1])
