"""Blocks whose update scales or interpolates the residual itself (Beam, MiniMax, Dory) and a block
that normalises its input before its residual (RWKV's block 0): every sublayer site reads the
model's real tensor times the factor HF applies, and an edit there changes the forward exactly as
the same change made by a hook on the HF module does."""

from __future__ import annotations

import math

import pytest
import torch

import conceptlens
from conceptlens.steering import Add
import transformers as tf

from tests.adapters import coverage
from tests.adapters.tiny_configs import build, tiny_config
from tests.conftest import Batches

IDS = torch.randint(4, 100, (2, 6), generator=torch.Generator().manual_seed(0))


def _minimax():
    config = tiny_config("minimax")
    config.full_attn_alpha_factor, config.full_attn_beta_factor = 2.0, 0.5
    config.linear_attn_alpha_factor, config.linear_attn_beta_factor = 1.5, 0.75
    config.mlp_alpha_factor, config.mlp_beta_factor = 3.0, 0.25
    torch.manual_seed(0)
    return tf.MiniMaxForCausalLM._from_config(config, attn_implementation="eager").eval()


def _dory():
    """Dory with learned per-channel rates (the default init makes every channel's rate equal)."""
    model = build("dory")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            for p in (layer.lambda_1, layer.lambda_2):
                p.copy_((torch.rand(p.shape, generator=g) * 0.1 + 0.01) * torch.sign(torch.randn(p.shape, generator=g)))
    return model


def _beam_scales(i: int) -> tuple[float, float, float]:
    """(resid_in coefficient, attn factor, mlp factor) of Beam's block i, from its depth_scaled_residual_add."""
    a, m = 2 * (i + 1), 2 * (i + 1) + 1
    ra, rm = math.sqrt((a - 1) / a), math.sqrt((m - 1) / m)
    return ra * rm, rm / math.sqrt(a), 1 / math.sqrt(m)


def _on_call(module, call: int, fn):
    """A forward hook on `module` that applies `fn` to its output's first tensor on its `call`-th call."""
    count = [-1]

    def hook(mod, args, out):
        count[0] += 1
        new = fn(out[0] if isinstance(out, tuple) else out) if count[0] == call else None
        if new is None:
            return None
        return (new, *out[1:]) if isinstance(out, tuple) else new

    return module.register_forward_hook(hook)


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits


def _check_site(model, site, module, call, factor):
    """site == factor * module's output, an Add there == adding vector / factor to that output, and a
    null Add is bit-identical."""
    lens = conceptlens.attach(model)
    assert not lens.adapter.problems, lens.adapter.problems
    seen = []
    handle = _on_call(module, call, lambda x: seen.append(x.clone()))
    try:
        cap = Batches()
        with torch.no_grad(), lens.capture([site], keep_shape=True, on_batch=cap):
            bare = model(input_ids=IDS, use_cache=False).logits
    finally:
        handle.remove()
    torch.testing.assert_close(cap.acts[site], factor * seen[0], rtol=1e-5, atol=1e-6)
    vector = torch.randn(lens.site(site).width, generator=torch.Generator().manual_seed(1))
    with lens.steer(Add(vector, site=site)):
        edited = _logits(model)
    handle = _on_call(module, call, lambda x: x + vector / factor)
    try:
        manual = _logits(model)
    finally:
        handle.remove()
    assert not torch.allclose(edited, bare, atol=1e-3)
    torch.testing.assert_close(edited, manual, rtol=1e-5, atol=1e-5)
    with lens.steer(Add(vector, 0.0, site=site)):
        assert torch.equal(_logits(model), bare)
    return lens


@pytest.mark.parametrize("i, kind", [(0, "attn_out"), (1, "attn_out"), (1, "mlp_out")])
def test_beam_sites_are_its_depth_scaled_adds(i, kind):
    model = build("beam")
    layer = model.model.layers[i]
    c0, ca, cm = _beam_scales(i)
    module = layer.post_attention_layernorm if kind == "attn_out" else layer.post_feedforward_layernorm
    lens = _check_site(model, f"blocks.{i}.{kind}", module, 0, ca if kind == "attn_out" else cm)
    assert lens.adapter.layout("", i).resid_coef == pytest.approx(c0, rel=1e-6)
    assert f"resid_out = {c0:.6g} * resid_in + attn_out + mlp_out" in lens.site(f"blocks.{i}.resid_out").source


@pytest.mark.parametrize("i, kind", [(0, "attn_out"), (1, "attn_out"), (1, "mlp_out")])
def test_minimax_sites_are_beta_times_the_sublayer(i, kind):
    model = _minimax()
    layer = model.model.layers[i]
    module = layer.self_attn if kind == "attn_out" else layer.mlp
    factor = layer.attn_beta_factor if kind == "attn_out" else layer.mlp_beta_factor
    lens = _check_site(model, f"blocks.{i}.{kind}", module, 0, factor)
    add = next(a for a in lens.adapter.layout("", i).adds if kind in a.kinds)
    alpha = layer.attn_alpha_factor if kind == "attn_out" else layer.mlp_alpha_factor
    assert add.coef == pytest.approx(alpha, rel=1e-6)
    coverage.check_model(model, {"input_ids": IDS, "use_cache": False},
                         model(input_ids=IDS, use_cache=False, output_hidden_states=True))


@pytest.mark.parametrize("i, kind", [(0, "attn_out"), (1, "attn_out"), (1, "mlp_out")])
def test_dory_sites_are_its_per_channel_interpolation_rates(i, kind):
    model = _dory()
    layer = model.model.layers[0]  # one layer, looped: block i is its i-th call
    lam, module = (layer.lambda_1, layer.post_attention_layernorm) if kind == "attn_out" else \
        (layer.lambda_2, layer.post_feedforward_layernorm)
    rate = (lam * layer.lambda_scale).abs().detach()
    lens = _check_site(model, f"blocks.{i}.{kind}", module, i, rate)
    assert f"affine in |lambda_{1 if kind == 'attn_out' else 2}|" in lens.site(f"blocks.{i}.{kind}").source
    add = next(a for a in lens.adapter.layout("", i).adds if kind in a.kinds)
    torch.testing.assert_close(add.coef, 1 - rate, rtol=0, atol=1e-6)
    with torch.no_grad():
        coverage.check_model(model, {"input_ids": IDS, "use_cache": False},
                             model(input_ids=IDS, use_cache=False, output_hidden_states=True))


def test_rwkv_block_0_resid_in_is_its_pre_ln_output():
    model = build("rwkv")
    block = model.rwkv.blocks[0]
    lens = _check_site(model, "blocks.0.resid_in", block.pre_ln, 0, 1.0)
    _check_site(model, "blocks.0.attn_out", block.attention, 0, 1.0)
    _check_site(model, "blocks.0.mlp_out", block.feed_forward, 0, 1.0)
    names = ["embed", "blocks.0.resid_in", "blocks.0.attn_out", "blocks.0.mlp_out", "blocks.0.resid_out"]
    cap = Batches()
    with torch.no_grad(), lens.capture(names, keep_shape=True, on_batch=cap):
        model(input_ids=IDS, use_cache=False)
    got = cap.acts
    torch.testing.assert_close(got["blocks.0.resid_in"], block.pre_ln(got["embed"]))
    torch.testing.assert_close(got["blocks.0.resid_in"] + got["blocks.0.attn_out"] + got["blocks.0.mlp_out"],
                               got["blocks.0.resid_out"], rtol=0, atol=1e-5)
    assert "normalised by pre_ln" in lens.site("blocks.0.resid_in").source
    assert "before its pre_ln" in lens.site("embed").source
