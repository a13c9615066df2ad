"""Qwen4-exp keeps 4 residual streams side by side (hyper-connections), HY-V4 in a dimension of
their own, and their sublayers work on one: their sites are what each writes back to the streams
(the output times the gate's per-stream weights), read bit for bit and edited exactly as a hook
adding the same change to the residual would."""

from __future__ import annotations

import contextlib

import pytest
import torch

import transformers as tf

import conceptlens
from conceptlens.hooks.points import hook_site
from conceptlens.steering import Add
from tests.adapters import coverage
from tests.adapters.tiny_configs import build, tiny_config
from tests.conftest import Batches


@pytest.fixture(scope="module")
def qwen4():
    model = build("qwen4_exp_text")
    return model, conceptlens.attach(model)


def _ids():
    return torch.randint(4, 100, (2, 6), generator=torch.Generator().manual_seed(0))


def test_the_sublayer_sites_are_the_outputs_spread_over_the_streams(qwen4):
    model, lens = qwen4
    assert not lens.adapter.problems
    layer = model.model.layers[0]
    seen = {}
    handles = [layer.linear_attn.register_forward_hook(lambda m, a, o: seen.update(a=o)),
               layer.mlp.register_forward_hook(lambda m, a, o: seen.update(f=o)),
               layer.attn_hyper_connection.register_forward_hook(lambda m, a, o: seen.update(w=o[2])),
               layer.mlp_hyper_connection.register_forward_hook(lambda m, a, o: seen.update(w2=o[2]))]
    names = ["blocks.0.mixer_out", "blocks.0.mlp_out"]
    try:
        cap = Batches()
        with torch.no_grad(), lens.capture(names, keep_shape=True, on_batch=cap):
            model(input_ids=_ids())
    finally:
        for h in handles:
            h.remove()
    by_hand = {"blocks.0.mixer_out": (seen["a"].unsqueeze(-2) * seen["w"].unsqueeze(-1)).flatten(-2),
               "blocks.0.mlp_out": (seen["f"].unsqueeze(-2) * seen["w2"].unsqueeze(-1)).flatten(-2)}
    for name in names:
        assert cap.acts[name].shape == (2, 6, 256)
        assert torch.equal(cap.acts[name], by_hand[name])  # the model's own tensor, bit for bit
    assert lens.site("final").width == 64  # the stream mixer merges the 4 streams


def _manual(model, ids, module, vector, point):
    """Logits with `vector` added to `module`'s input ("input") or output by a plain torch hook."""
    if point == "input":
        handle = module.register_forward_pre_hook(lambda m, args: (args[0] + vector, *args[1:]))
    else:
        handle = module.register_forward_hook(
            lambda m, args, out: (out[0] + vector, *out[1:]) if isinstance(out, tuple) else out + vector)
    try:
        with torch.no_grad():
            return model(input_ids=ids).logits
    finally:
        handle.remove()


@pytest.mark.parametrize("capture_first", [False, True])
@pytest.mark.parametrize("site, where", [("blocks.0.mixer_out", "input"), ("blocks.1.attn_out", "input"),
                                         ("blocks.0.mlp_out", "output"), ("blocks.1.mlp_out", "output")])
def test_an_add_at_a_spread_site_equals_adding_it_to_the_streams_by_hand(qwen4, site, where, capture_first):
    model, lens = qwen4
    i = int(site.split(".")[1])
    layer = model.model.layers[i]
    ids = _ids()
    vector = torch.randn(256, generator=torch.Generator().manual_seed(1))
    target = layer.mlp_hyper_connection if where == "input" else layer
    expected = _manual(model, ids, target, vector, where)
    with torch.no_grad():
        bare = model(input_ids=ids).logits
    names = [site, f"blocks.{i}.resid_out"]
    cap = Batches()
    with torch.no_grad(), contextlib.ExitStack() as scopes:
        if capture_first:  # edits run before reads at a site, whatever order the scopes open in
            scopes.enter_context(lens.capture(names, keep_shape=True, on_batch=cap))
        scopes.enter_context(lens.steer(Add(vector, site=site)))
        if not capture_first:
            scopes.enter_context(lens.capture(names, keep_shape=True, on_batch=cap))
        logits = model(input_ids=ids).logits
    assert not torch.allclose(logits, bare, atol=1e-3)  # the edit did something
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    plain = Batches()
    with torch.no_grad(), lens.capture([site, f"blocks.{i}.resid_out"], keep_shape=True, on_batch=plain):
        model(input_ids=ids)
    # a read after an edit at the site sees the edit; in the last sublayer, so does resid_out
    torch.testing.assert_close(cap.acts[site], plain.acts[site] + vector, rtol=0, atol=1e-5)
    if where == "output":
        out = f"blocks.{i}.resid_out"
        torch.testing.assert_close(cap.acts[out], plain.acts[out] + vector, rtol=0, atol=1e-5)
    with torch.no_grad(), lens.steer(Add(vector, 0.0, site=site)):
        assert torch.equal(model(input_ids=ids).logits, bare)  # a null edit is bit-identical
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in layer.modules())  # none left behind


def test_per_layer_ngram_embeddings_are_a_further_branch_into_the_streams():
    config = tiny_config("qwen4_exp_text")
    # on layer 0 (linear attention) only: with a cache, transformers cannot run one on an attention layer
    config.ple_layer_ids, config.ngram_vocab_size_base, config.ple_embed_dim, config.eos_token_id = [1], 1000, 32, 1
    config.number_of_conv_states = 3  # what the config derives from ple_layer_ids when it is built with them
    torch.manual_seed(0)
    model = tf.Qwen4ExpForCausalLM._from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        model.model.layers[0].ple.conv1d.weight.normal_()  # zero at init: let the short convolution count
    inputs = coverage.inputs_for(model)
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True, use_cache=False)
    coverage.check_model(model, {**inputs, "use_cache": False}, out)  # resid_in + branch + spread sublayers
    coverage.check_attention(model, inputs)
    coverage.check_kv_cache(model, inputs)
    lens = conceptlens.attach(model)
    ids, vector = _ids(), torch.randn(256, generator=torch.Generator().manual_seed(4))
    for site, module in (("blocks.0.branch_out", model.model.layers[0].ple),
                         ("blocks.0.mixer_out", model.model.layers[0].mlp_hyper_connection)):
        point = "output" if site.endswith("branch_out") else "input"
        expected = _manual(model, ids, module, vector, point)
        with torch.no_grad(), lens.steer(Add(vector, site=site)):
            torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=1e-5)


def test_hy_v4_streams_in_their_own_dimension_and_a_residual_the_block_adds_itself():
    """HY-V4 keeps (B, T, 4, d) streams; its ffn_hc reads the residual after attention and the block
    adds that residual to its output itself: an edit at attn_out moves both, as recomputed by hand."""
    model = build("hy_v4")
    lens = conceptlens.attach(model)
    assert not lens.adapter.problems and lens.adapter.layout("", 0).additive
    layer, ids = model.model.layers[0], _ids()
    seen = {}
    handles = [layer.self_attn.register_forward_hook(lambda m, a, o: seen.update(a=o[0])),
               layer.attn_hc.register_forward_hook(lambda m, a, o: seen.update(post=o[0])),
               layer.ffn_hc.register_forward_hook(lambda m, a, o: seen.update(r2=a[0]))]
    try:
        cap = Batches()
        with torch.no_grad(), lens.capture(["blocks.0.attn_out", "blocks.0.resid_out"], keep_shape=True, on_batch=cap):
            model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    assert torch.equal(cap.acts["blocks.0.attn_out"], seen["post"].unsqueeze(-1) * seen["a"].unsqueeze(-2))
    vector = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))  # one direction per stream
    with torch.no_grad():  # the block's second half by hand, from the residual after attention moved by vector
        r2 = seen["r2"] + vector
        post, collapsed = layer.ffn_hc(r2)
        f = layer.mlp(layer.post_attention_layernorm(collapsed))
        by_hand = post.unsqueeze(-1) * f.unsqueeze(-2) + r2
    handle = hook_site(lens.hooks, lens.site("blocks.0.attn_out"), lambda x: x + vector, edit=True)  # steering's primitive
    try:
        edited = Batches()
        with torch.no_grad(), lens.capture(["blocks.0.resid_out"], keep_shape=True, on_batch=edited):
            model(input_ids=ids)
    finally:
        handle.remove()
    torch.testing.assert_close(edited.acts["blocks.0.resid_out"], by_hand, rtol=0, atol=1e-5)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in layer.modules())


@pytest.mark.parametrize("model_type", ["hy_v4", "deepseek_v4"])
def test_a_residual_of_streams_in_their_own_dimension_is_steered_as_its_flat_width(model_type):
    model = build(model_type)
    lens = conceptlens.attach(model)
    site = lens.site("blocks.0.resid_out")
    assert site.shape == ("B", "T", 4, 64)  # the tensor the hooks see, streams and all
    ids, vector = _ids(), torch.randn(256, generator=torch.Generator().manual_seed(6))
    expected = _manual(model, ids, model.model.layers[0], vector.view(4, 64), "output")
    with torch.no_grad(), lens.steer(Add(vector, site="blocks.0.resid_out")):  # edits see (B, T, 4 * 64)
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=1e-6)
