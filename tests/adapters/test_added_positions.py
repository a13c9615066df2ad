"""Stacks whose blocks run on positions the model adds to the tokens (CPM-Ant's prompt prefix):
sites are this forward's tokens, read exactly and edited exactly as a hook on HF's module would."""

from __future__ import annotations

import torch

import conceptlens
from conceptlens.sites.hooked_views import Trim
from conceptlens.steering import Add
from tests.adapters import coverage
from tests.adapters.tiny_configs import build


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def test_cpmant_sites_are_the_tokens_after_its_prompt():
    model = build("cpmant")
    lens = conceptlens.attach(model)
    inputs = {**coverage.inputs_for(model), "use_cache": False}
    prompt = model.config.prompt_length
    layer = model.cpmant.encoder.layers[0]
    seen = {}
    handle = layer.self_att.self_attention.attention_out.register_forward_hook(
        lambda m, a, out: seen.update(attn=out.detach().clone()))
    try:
        with torch.no_grad():
            out = model(**inputs, output_hidden_states=True)
    finally:
        handle.remove()
    acts = coverage.capture_all(lens, model, inputs, ["embed", "blocks.0.attn_out", "blocks.1.resid_out", "final"])
    trim = lens.site("blocks.0.resid_out").find(Trim)
    assert trim is not None and trim.last
    assert seen["attn"].shape[1] == prompt + 6 and acts["blocks.0.attn_out"].shape == (2, 6, 64)
    assert torch.equal(acts["blocks.0.attn_out"], seen["attn"][:, prompt:])  # the tokens, not the prompt
    assert torch.equal(acts["embed"], out.hidden_states[0])
    assert torch.equal(acts["final"], out.hidden_states[2])

    vector = torch.linspace(-1, 1, 64)
    with lens.steer(Add(vector, 2.0, site="blocks.0.resid_out"), positions=slice(1, 3)):
        steered = _logits(model, inputs)

    def manual(module, args, output):  # the same edit by hand: tokens 1 and 2 sit after the prompt
        hidden = output[0].clone()
        hidden[:, prompt + 1: prompt + 3] += 2.0 * vector
        return (hidden, *output[1:])

    handle = layer.register_forward_hook(manual)
    try:
        expected = _logits(model, inputs)
    finally:
        handle.remove()
    assert torch.allclose(steered, expected, atol=1e-6) and not torch.allclose(steered, _logits(model, inputs))
    base = _logits(model, inputs)
    with lens.steer(Add(vector, 1.0, site="blocks.1.mlp_out"), Add(vector, -1.0, site="blocks.1.mlp_out")):
        assert torch.equal(_logits(model, inputs), base)  # a null edit is bit-identical


def _record(module, calls):
    return module.register_forward_hook(lambda m, a, out: calls.append((out[0] if isinstance(out, tuple) else out)
                                                                       .detach().clone()))


def _patch_rows(module, rows, vector, first_only=False):
    """A hand-made hook adding `vector` at `rows` of the module's output (its first call per forward)."""
    seen = []

    def hook(m, args, out):
        seen.append(1)
        if first_only and len(seen) % 2 == 0:
            return None
        x = (out[0] if isinstance(out, tuple) else out).clone()
        x[:, rows] += vector
        return (x, *out[1:]) if isinstance(out, tuple) else x

    return module.register_forward_hook(hook)


def test_pegasus_x_sites_are_its_tokens_in_the_padded_encoder():
    model = build("pegasus_x")
    lens = conceptlens.attach(model)
    inputs = {**coverage.inputs_for(model), "use_cache": False}
    encoder = model.model.encoder
    pad = model.config.block_size // 2
    assert lens.adapter.padded_hidden == {"encoder"}
    attn, fc2 = [], []
    handles = [_record(encoder.layers[1].self_attn, attn), _record(encoder.layers[0].fc2, fc2)]
    out = coverage.forward_with(model, inputs, handles, output_hidden_states=True)
    names = ["encoder.embed", "encoder.blocks.0.resid_out", "encoder.blocks.0.mlp_out", "encoder.blocks.1.attn_out",
             "encoder.final"]
    acts = coverage.capture_all(lens, model, inputs, names)
    assert out.encoder_hidden_states[1].shape[1] == model.config.block_size  # HF keeps the padding
    assert torch.equal(acts["encoder.embed"], out.encoder_hidden_states[0][:, :6])
    assert torch.equal(acts["encoder.blocks.0.resid_out"], out.encoder_hidden_states[1][:, :6])
    assert torch.equal(acts["encoder.final"], out.encoder_last_hidden_state)
    assert len(fc2) == 2 and fc2[1].shape[1] == model.config.num_global_tokens  # tokens, then global tokens
    assert torch.equal(acts["encoder.blocks.0.mlp_out"], fc2[0][:, :6])
    assert attn[0].shape[1] == model.config.block_size + 2 * pad  # staggered: padded on both sides
    assert torch.equal(acts["encoder.blocks.1.attn_out"], attn[0][:, pad:pad + 6])

    vector = torch.linspace(-1, 1, 64)
    base = _logits(model, inputs)
    for site, module, rows, first_only in (("encoder.blocks.1.attn_out", encoder.layers[1].self_attn,
                                            slice(pad + 1, pad + 3), False),
                                           ("encoder.blocks.0.mlp_out", encoder.layers[0].fc2, slice(1, 3), True)):
        with lens.steer(Add(vector, 1.0, site=site), positions=slice(1, 3)):
            steered = _logits(model, inputs)
        handle = _patch_rows(module, rows, vector, first_only)
        try:
            expected = _logits(model, inputs)
        finally:
            handle.remove()
        assert torch.allclose(steered, expected, atol=1e-6) and not torch.allclose(steered, base), site
        with lens.steer(Add(vector, 1.0, site=site), Add(vector, -1.0, site=site)):
            assert torch.equal(_logits(model, inputs), base)  # a null edit is bit-identical
