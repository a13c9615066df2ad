"""Edits at attn.k / attn.v reach every kind of KV cache: static (sliding layers included),
quantised, encoder-decoder (cross-attention), and forwards with gradients enabled."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.cache_utils import DynamicCache, QuantizedCache, StaticCache

import conceptlens
from conceptlens.steering import Add
from tests.conftest import _LLAMA_LIKE, Batches, hook_snapshot, tiny_model

POSITIONS = ["all", "prompt", "generated", slice(2, 6)]


def _sliding_gemma2():
    """Gemma 2 with a 3-token window: generation runs past it, so sliding layers drop keys."""
    torch.manual_seed(0)
    config = tf.Gemma2Config(**_LLAMA_LIKE, head_dim=8, sliding_window=3)
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def _sliding_only():
    """Mistral with every layer sliding (3 tokens): a static cache's masks show only the window."""
    torch.manual_seed(0)
    return tf.MistralForCausalLM(tf.MistralConfig(**_LLAMA_LIKE, sliding_window=3)).eval()


def _models():
    return {"llama": lambda: tiny_model("llama"), "gpt2": lambda: tiny_model("gpt2"), "gemma2": _sliding_gemma2,
            "sliding-only": _sliding_only}


def _generate(model, lens, edit, positions, **kwargs):
    ids = torch.randint(3, 99, (2, 5), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :1] = 0  # left padding on one row
    with torch.no_grad(), lens.steer(edit, positions=positions):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.scores)


def _edit(lens, site_name, seed=3):
    site = lens.site(site_name)
    vector = torch.randn(site.shape[2] * site.shape[3], generator=torch.Generator().manual_seed(seed)) * 3
    return Add(vector, site=site.name)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2", "sliding-only"])
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("positions", POSITIONS, ids=str)
def test_static_cache_gives_the_tokens_and_logits_of_no_cache(family, which, positions):
    model = _models()[family]()
    lens = conceptlens.attach(model)
    edit = _edit(lens, f"blocks.0.attn.{which}")
    fresh, fresh_scores = _generate(model, lens, edit, positions, use_cache=False)
    static, static_scores = _generate(model, lens, edit, positions, cache_implementation="static")
    dynamic, dynamic_scores = _generate(model, lens, edit, positions)
    assert torch.equal(static, fresh) and torch.equal(dynamic, fresh)
    torch.testing.assert_close(static_scores, fresh_scores, rtol=0, atol=1e-5)
    torch.testing.assert_close(dynamic_scores, fresh_scores, rtol=0, atol=1e-5)


def test_a_static_cache_object_passed_by_hand_keeps_the_edit():
    model = tiny_model("llama")
    lens = conceptlens.attach(model)
    edit = _edit(lens, "blocks.1.attn.v")
    fresh, fresh_scores = _generate(model, lens, edit, "generated", use_cache=False)
    cache = StaticCache(config=model.config, max_cache_len=16)
    static, static_scores = _generate(model, lens, edit, "generated", cache=cache)
    assert torch.equal(static, fresh)
    torch.testing.assert_close(static_scores, fresh_scores, rtol=0, atol=1e-5)
    assert "update" not in vars(cache)  # the cache's update is its own again


@pytest.mark.parametrize("which", ["k", "v"])
def test_k_v_reads_see_this_forwards_tokens_with_a_static_cache(which):
    model = tiny_model("llama")
    lens = conceptlens.attach(model)
    site = f"blocks.0.attn.{which}"
    ids = torch.randint(3, 99, (2, 5), generator=torch.Generator().manual_seed(4))
    bare, cached = Batches(), Batches()
    with torch.no_grad(), lens.capture(site, keep_shape=True, on_batch=bare):
        model(input_ids=ids)
    with torch.no_grad(), lens.capture(site, keep_shape=True, on_batch=cached):
        model(input_ids=ids, cache=StaticCache(config=model.config, max_cache_len=12), use_cache=True)
    torch.testing.assert_close(cached.acts[site], bare.acts[site], rtol=0, atol=1e-6)


@pytest.mark.parametrize("which", ["k", "v"])
def test_the_quantised_cache_stores_the_edited_keys_and_values(which):
    model = tiny_model("llama")
    lens = conceptlens.attach(model)
    site = f"blocks.0.attn.{which}"
    edit = _edit(lens, site)
    ids = torch.randint(3, 99, (2, 5), generator=torch.Generator().manual_seed(5))
    seen = Batches()
    with torch.no_grad(), lens.steer(edit), lens.capture(site, keep_shape=True, on_batch=seen):
        model(input_ids=ids)  # the edited k/v, as an uncached forward uses them
        cache = QuantizedCache("fp8", model.config)
        model(input_ids=ids, cache=cache, use_cache=True)
    layer = cache.layers[0]
    stored = layer._dequantize(layer._quantized_keys if which == "k" else layer._quantized_values)
    expected = seen.acts[site].transpose(1, 2)
    torch.testing.assert_close(stored, layer._dequantize(layer._quantize(expected)), rtol=0, atol=0)


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_edits_reach_the_cache_with_gradients_enabled(which, kind):
    model = tiny_model("llama")
    lens = conceptlens.attach(model)
    edit = _edit(lens, f"blocks.0.attn.{which}")
    ids = torch.randint(3, 99, (1, 6), generator=torch.Generator().manual_seed(6))
    with torch.enable_grad(), lens.steer(edit):
        full = model(input_ids=ids).logits[:, -1]
        cache = DynamicCache(config=model.config) if kind == "dynamic" else \
            StaticCache(config=model.config, max_cache_len=8)
        model(input_ids=ids[:, :-1], cache=cache, use_cache=True)
        step = model(input_ids=ids[:, -1:], cache=cache, use_cache=True).logits[:, -1]
        assert step.requires_grad
    torch.testing.assert_close(step, full, rtol=0, atol=1e-5)
    if kind == "dynamic":  # (a static cache's in-place writes break backward in transformers itself)
        step.sum().backward()  # the edited keys/values stored in the cache are part of the graph
        assert model.model.layers[0].self_attn.k_proj.weight.grad is not None


@pytest.mark.parametrize("site", ["decoder.blocks.0.cross_attn.k", "decoder.blocks.0.cross_attn.v",
                                  "decoder.blocks.1.attn.k", "decoder.blocks.1.attn.v"])
def test_encoder_decoder_cache_self_and_cross_attention(site):
    model = tiny_model("bart")
    lens = conceptlens.attach(model)
    edit = _edit(lens, site)
    ids = torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(7))
    runs = {}
    for use_cache in (True, False):
        with torch.no_grad(), lens.steer(edit):
            out = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, use_cache=use_cache,
                                 output_scores=True, return_dict_in_generate=True)
        runs[use_cache] = out.sequences, torch.stack(out.scores)
    assert torch.equal(runs[True][0], runs[False][0])
    torch.testing.assert_close(runs[True][1], runs[False][1], rtol=0, atol=1e-5)


def test_no_hook_and_no_patched_update_remain_after_an_error():
    model = tiny_model("llama")
    before = hook_snapshot(model)
    lens = conceptlens.attach(model)
    cache = StaticCache(config=model.config, max_cache_len=4)
    with pytest.raises(Exception), torch.no_grad(), lens.steer(_edit(lens, "blocks.0.attn.k")):
        model(input_ids=torch.randint(3, 99, (1, 6)), cache=cache, use_cache=True)  # longer than the cache
    assert "update" not in vars(cache)
    assert hook_snapshot(model) == before


def test_a_module_that_changes_k_v_after_the_cache_is_refused_and_left_clean():
    from tests.adapters.tiny_configs import build

    model = build("diffllama")  # splits v into two halves after storing it
    before = hook_snapshot(model)
    lens = conceptlens.attach(model)
    edit = _edit(lens, "blocks.0.attn.v")
    ids = torch.randint(3, 99, (1, 5), generator=torch.Generator().manual_seed(8))
    with pytest.raises(ValueError, match="DiffLlamaAttention attends to other keys/values than it stores in its "
                                         "DynamicCache.*use_cache=False"):
        _generate(model, lens, edit, "all")
    assert hook_snapshot(model) == before
    _generate(model, lens, edit, "all", use_cache=False)  # without a cache the edit applies
