"""Structural adapters on specific layouts: Gemma 3's post-sublayer norms, layer descriptions,
names users already have (TransformerLens, HF module paths), and the z / mlp.post / pattern sites."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import conceptlens
from tests.conftest import Batches, tiny_inputs, tiny_model


def _gemma3(window: int = 4):
    config = tf.Gemma3TextConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=8, vocab_size=99, max_position_embeddings=64,
                                 sliding_window=window, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    return tf.Gemma3ForCausalLM(config).eval()


def test_gemma3_sublayer_outputs_are_after_their_post_norms_and_add_up():
    model = _gemma3()
    lens = conceptlens.attach(model)
    layer = model.model.layers[0]
    assert lens.site("blocks.0.attn_out").module is layer.post_attention_layernorm
    assert lens.site("blocks.0.mlp_out").module is layer.post_feedforward_layernorm
    ids = torch.randint(3, 99, (2, 9), generator=torch.Generator().manual_seed(0))  # longer than the window
    names = [f"blocks.{i}.{k}" for i in range(2) for k in ("resid_in", "attn_out", "mlp_out", "resid_out")]
    cap = Batches()
    with torch.no_grad(), lens.capture(names, keep_shape=True, on_batch=cap):
        model(input_ids=ids)
    acts = cap.acts
    for i in range(2):
        total = acts[f"blocks.{i}.resid_in"] + acts[f"blocks.{i}.attn_out"] + acts[f"blocks.{i}.mlp_out"]
        torch.testing.assert_close(total, acts[f"blocks.{i}.resid_out"], rtol=1e-5, atol=1e-5)


def test_descriptions_say_sliding_window_or_global_and_rotary_base():
    lens = conceptlens.attach(_gemma3(window=4))
    sliding, full = lens.site("blocks.0.attn.q").source, lens.site("blocks.1.attn.q").source
    assert "sliding-window attention (window 4)" in sliding and "rotary base 10000" in sliding
    assert "global attention" in full and "rotary base 1e+06" in full
    assert "rotary base 10000" in conceptlens.attach(tiny_model("llama")).site("blocks.0.attn.k").source


def test_transformer_lens_and_hf_module_names():
    model = tiny_model("llama")
    lens = conceptlens.attach(model)
    pairs = {"blocks.1.hook_resid_post": "blocks.1.resid_out", "blocks.0.hook_resid_pre": "blocks.0.resid_in",
             "blocks.0.hook_attn_out": "blocks.0.attn_out", "blocks.-1.hook_mlp_out": "blocks.1.mlp_out",
             "blocks.0.attn.hook_rot_q": "blocks.0.attn.q", "blocks.0.attn.hook_rot_k": "blocks.0.attn.k",
             "blocks.0.attn.hook_q": "blocks.0.attn.q_pre", "blocks.0.attn.hook_k": "blocks.0.attn.k_pre",
             "blocks.0.attn.hook_v": "blocks.0.attn.v", "blocks.0.attn.hook_z": "blocks.0.attn.z",
             "blocks.0.mlp.hook_post": "blocks.0.mlp.post", "blocks.0.attn.hook_pattern": "blocks.0.attn.pattern",
             "model.layers.1": "blocks.1.resid_out",
             "model.layers.0.mlp": "blocks.0.mlp_out", "layers.0.self_attn": "blocks.0.attn_out", "model.norm": "final"}
    for name, canonical in pairs.items():
        assert lens.site_name(name) == canonical, name
    with pytest.raises(KeyError, match="no site"):
        lens.site("model.layers.0.self_attn.rotary_nonexistent")
    # a module whose *input* is a site names no site: its output is another tensor
    with pytest.raises(KeyError, match="output is no site here; its input is blocks.0.mlp.post, and its parent's "
                                       "output is blocks.0.mlp_out"):
        lens.site("model.layers.0.mlp.down_proj")
    with pytest.raises(KeyError, match="its input is blocks.0.attn.z, and its parent's output is blocks.0.attn_out"):
        lens.site("model.layers.0.self_attn.o_proj")
    with pytest.raises(KeyError, match="before the norm's weight and bias.*; final is the norm's output"):
        lens.site("ln_final.hook_normalized")
    t5 = conceptlens.attach(tiny_model("t5"))  # a stack's prefix names the stack's own site
    with pytest.raises(KeyError, match="; encoder.blocks.0.mlp.in is the norm's output"):
        t5.site("encoder.blocks.0.ln2.hook_normalized")


def test_pre_rotary_q_is_the_projection_and_rotary_q_differs():
    model = tiny_model("llama")
    lens = conceptlens.attach(model)
    ids = torch.randint(3, 99, (1, 6), generator=torch.Generator().manual_seed(0))
    cap = Batches()
    with torch.no_grad(), lens.capture(["blocks.0.attn.q_pre", "blocks.0.attn.q"], keep_shape=True, on_batch=cap):
        model(input_ids=ids)
    pre, rot = cap.acts["blocks.0.attn.q_pre"], cap.acts["blocks.0.attn.q"]
    torch.testing.assert_close(pre[:, 0], rot[:, 0])  # position 0: rotation by angle 0
    assert not torch.allclose(pre[:, 1:], rot[:, 1:])
    torch.testing.assert_close(pre.norm(dim=-1), rot.norm(dim=-1), rtol=1e-5, atol=1e-5)  # rotations keep norms


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "t5", "bart", "gemma2"])
def test_z_post_and_pattern_sites(family):
    model = tiny_model(family, attn="eager")
    lens = conceptlens.attach(model)
    inputs = tiny_inputs(family)
    p = "decoder." if family in ("t5", "bart") else ""
    names = [f"{p}blocks.0.attn.z", f"{p}blocks.0.mlp.post", f"{p}blocks.0.attn.pattern", f"{p}blocks.0.attn.v"]
    cap = Batches()
    with torch.no_grad(), lens.capture(names, keep_shape=True, on_batch=cap):
        out = model(**inputs, output_attentions=True)
    acts = cap.acts
    weights = out.decoder_attentions[0] if p else out.attentions[0]  # (B, H, T, S)
    pattern = acts[f"{p}blocks.0.attn.pattern"].transpose(1, 2)
    torch.testing.assert_close(pattern, weights, rtol=1e-5, atol=1e-6)
    # z = pattern @ v per head, before the output projection
    v = acts[f"{p}blocks.0.attn.v"].transpose(1, 2)  # (B, H_kv, T, d)
    v = v.repeat_interleave(pattern.shape[1] // v.shape[1], dim=1)
    z = (pattern @ v).transpose(1, 2)
    torch.testing.assert_close(acts[f"{p}blocks.0.attn.z"], z, rtol=1e-4, atol=1e-5)
    post = acts[f"{p}blocks.0.mlp.post"]
    assert post.shape[-1] == lens.site(f"{p}blocks.0.mlp.post").shape[-1] > model.config.get_text_config().to_dict().get(
        "hidden_size", 0) // 2


@pytest.mark.parametrize("family, attn", [("llama", "sdpa"), ("bert", "sdpa"), ("bart", "sdpa"),
                                          ("llama", "flex_attention")])
@pytest.mark.parametrize("padded", [False, True])
def test_pattern_is_the_kernels_pattern_under_every_implementation(family, attn, padded):
    """Unpadded, sdpa is handed no mask and masks by is_causal; flex is handed a BlockMask: the
    pattern still equals eager attention's weights (an encoder's stays unmasked; a pad query's row
    is eager's uniform one, not NaN)."""
    model = tiny_model(family, attn=attn)
    lens = conceptlens.attach(model)
    inputs = tiny_inputs(family)
    if not padded:
        inputs = {k: v for k, v in inputs.items() if k != "attention_mask"}
    p = "decoder." if family == "bart" else ""
    with torch.no_grad(), lens.capture([f"{p}blocks.0.attn.pattern"], keep_shape=True) as cap:
        acts, _ = cap.forward(**inputs)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    weights = (out.decoder_attentions if p else out.attentions)[0].transpose(1, 2)  # (B, T, H, S)
    torch.testing.assert_close(acts[f"{p}blocks.0.attn.pattern"], weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_attach_probe_leaves_the_model_exactly_as_it_was(family):
    from tests.conftest import hook_snapshot

    model = tiny_model(family)
    model.train()
    before = hook_snapshot(model)
    conceptlens.attach(model)
    assert hook_snapshot(model) == before and model.training
    assert not hasattr(model, "_output_capturing_hooks_installed")


def test_module_paths_that_name_no_single_site_say_why():
    from tests.adapters.tiny_configs import build

    lens = conceptlens.attach(build("granitemoeshared"))
    with pytest.raises(KeyError, match=r"one part of blocks\.0\.mlp_out, which is the sum of 2 modules"):
        lens.site("model.layers.0.shared_mlp")
    assert lens.site_name("model.layers.0.self_attn") == "blocks.0.attn_out"
    lens = conceptlens.attach(build("albert"))
    with pytest.raises(KeyError, match=r"one shared layer run as 2 blocks \(blocks\.0, blocks\.1\).*blocks\.0\.resid_out"):
        lens.site("albert.encoder.albert_layer_groups.0.albert_layers.0")
