"""Attention calls whose keys are this forward's tokens followed by others (adapters/keys.py).

T5Gemma2's decoder attends to [decoder keys; encoder keys] in one call: attn.k/v are the
decoder part, cross_attn.k/v the encoder part, the two patterns HF's split of its weights.
DeepSeek V4 appends its compressor's entries to the tokens' keys (which are also its values):
attn.k/v are the tokens' part, the pattern covers every key. Each read is checked against the
tensor recomputed from HF's modules, each edit against the same change made by a hand-written
hook, and T5Gemma2's edits against generation with and without a KV cache.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as ds

import conceptlens
from conceptlens.hooks.attention import active_hook_count
from conceptlens.steering import Add
from tests.adapters.tiny_configs import build
from tests.conftest import Batches


def _ids(length, seed=0):
    return torch.randint(4, 100, (2, length), generator=torch.Generator().manual_seed(seed))


def _vector(site, seed=1):
    return torch.randn(site.shape[2] * site.shape[3], generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def t5gemma2():
    model = build("t5gemma2")
    return model, conceptlens.attach(model)


def _t5_inputs():
    return {"input_ids": _ids(6), "decoder_input_ids": _ids(4, 1), "use_cache": False}


def test_t5gemma2_merged_attention_sites_are_its_two_parts(t5gemma2):
    model, lens = t5gemma2
    assert not lens.adapter.problems
    attn = model.model.decoder.layers[1].self_attn
    names = [f"decoder.blocks.1.{s}" for s in ("attn.k", "attn.v", "cross_attn.k", "cross_attn.v", "attn.pattern",
                                               "cross_attn.pattern", "resid_in")]
    seen = {}
    handle = attn.k_norm.register_forward_hook(lambda m, a, out: seen.setdefault("k", []).append(out))
    try:
        cap = Batches()
        with torch.no_grad(), lens.capture(names, keep_shape=True, on_batch=cap):
            out = model(**_t5_inputs(), output_attentions=True)
    finally:
        handle.remove()
    acts = cap.acts
    encoder = out.encoder_last_hidden_state
    with torch.no_grad():  # the encoder part by hand: k_norm(k_proj(encoder)), v_proj(encoder); no rotary
        cross_v = attn.v_proj(encoder).view(2, 6, -1, attn.head_dim)
        own_v = attn.v_proj(model.model.decoder.layers[1].pre_self_attn_layernorm(acts[names[-1]]))
    torch.testing.assert_close(acts["decoder.blocks.1.cross_attn.v"], cross_v, rtol=0, atol=0)
    torch.testing.assert_close(acts["decoder.blocks.1.attn.v"], own_v.view(2, 4, -1, attn.head_dim), rtol=0, atol=0)
    torch.testing.assert_close(acts["decoder.blocks.1.cross_attn.k"], seen["k"][1].transpose(1, 2), rtol=0, atol=0)
    assert acts["decoder.blocks.1.attn.k"].shape == (2, 4, 2, attn.head_dim)
    # the two patterns are HF's own split of its merged weights
    torch.testing.assert_close(acts["decoder.blocks.1.attn.pattern"].transpose(1, 2), out.decoder_attentions[1],
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(acts["decoder.blocks.1.cross_attn.pattern"].transpose(1, 2), out.cross_attentions[1],
                               rtol=0, atol=1e-6)
    assert "merged" in lens.site("decoder.blocks.1.cross_attn.k").source
    assert "decoder.blocks.1.cross_attn.k_pre" not in lens.sites  # k_proj runs on both stacks' tokens
    assert "decoder.blocks.1.cross_attn_out" not in lens.sites  # one call: attn_out holds both
    assert "self- and cross-attention in one call" in lens.site("decoder.blocks.1.attn_out").source


@pytest.mark.parametrize("site_name, call", [("decoder.blocks.0.attn.v", 0), ("decoder.blocks.0.cross_attn.v", 1)])
def test_t5gemma2_an_edit_equals_the_same_change_at_v_proj(t5gemma2, site_name, call):
    """v_proj runs on the decoder's tokens, then the encoder's: the value rows of each part."""
    model, lens = t5gemma2
    site = lens.site(site_name)
    vector = _vector(site)
    proj = model.model.decoder.layers[0].self_attn.v_proj
    calls = []

    def manual(module, args, out):
        calls.append(None)
        return out + vector if len(calls) == call + 1 else None

    handle = proj.register_forward_hook(manual)
    try:
        with torch.no_grad():
            expected = model(**_t5_inputs()).logits
    finally:
        handle.remove()
    with torch.no_grad(), lens.steer(Add(vector, site=site_name)):
        got = model(**_t5_inputs()).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    with torch.no_grad():
        bare = model(**_t5_inputs()).logits
        with lens.steer(Add(vector, 0.0, site=site_name)):
            assert torch.equal(model(**_t5_inputs()).logits, bare)  # a null edit is bit-identical


def _generate(model, lens, edit, positions="all", **kwargs):
    ids = _ids(6)
    mask = torch.ones_like(ids)
    mask[0, :1] = 0  # left padding on one row
    with torch.no_grad(), lens.steer(edit, positions=positions):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.scores)


@pytest.mark.parametrize("positions", ["all", "generated", slice(1, 3)], ids=str)
@pytest.mark.parametrize("site_name", ["decoder.blocks.0.attn.k", "decoder.blocks.1.attn.v",
                                       "decoder.blocks.0.cross_attn.k", "decoder.blocks.1.cross_attn.v"])
def test_t5gemma2_edits_give_the_same_generation_with_and_without_a_cache(t5gemma2, site_name, positions):
    model, lens = t5gemma2
    vector = _vector(lens.site(site_name), 3) * 3
    fresh, fresh_scores = _generate(model, lens, Add(vector, site=site_name), positions, use_cache=False)
    cached, cached_scores = _generate(model, lens, Add(vector, site=site_name), positions, use_cache=True)
    static, static_scores = _generate(model, lens, Add(vector, site=site_name), positions,
                                      cache_implementation="static")
    _, bare_scores = _generate(model, lens, Add(vector, 0.0, site=site_name), positions, use_cache=True)
    assert torch.equal(cached, fresh) and torch.equal(static, fresh)
    torch.testing.assert_close(cached_scores, fresh_scores, rtol=0, atol=1e-5)
    torch.testing.assert_close(static_scores, fresh_scores, rtol=0, atol=1e-5)
    changed = bool((bare_scores - fresh_scores).abs().max() > 1e-3)
    assert changed != (positions == "generated" and "cross_attn" in site_name)  # the encoder's tokens: all prompt


def test_t5gemma2_reads_with_a_cache_equal_reads_without(t5gemma2):
    model, lens = t5gemma2
    names = ["decoder.blocks.1.cross_attn.k", "decoder.blocks.1.attn.pattern", "decoder.blocks.1.cross_attn.pattern"]
    inputs = {k: v for k, v in _t5_inputs().items() if k != "use_cache"}
    fresh = Batches()
    with torch.no_grad(), lens.capture(names, keep_shape=True, on_batch=fresh):
        model(**inputs, use_cache=False)
    cached = Batches()
    with torch.no_grad(), lens.capture(names, keep_shape=True, on_batch=cached):
        model(**inputs, use_cache=True)
    for name in names:
        torch.testing.assert_close(cached.acts[name], fresh.acts[name], rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def deepseek_v4():
    model = build("deepseek_v4")
    return model, conceptlens.attach(model)


def _manual_attention(monkeypatch, which, vector, layer):
    """The reference: DeepSeek V4's own eager kernel, with `vector` added to the first T rows
    of the key or the value it receives (the two are one tensor: the other stays as it was)."""
    original = ds.eager_attention_forward

    def patched(module, query, key, value, *args, **kwargs):
        if module.layer_idx == layer:
            t, add = query.shape[2], vector.view(1, 1, 1, -1)
            if which == "k":
                key = torch.cat([key[:, :, :t] + add, key[:, :, t:]], dim=2)
            else:
                value = torch.cat([value[:, :, :t] + add, value[:, :, t:]], dim=2)
        return original(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(ds, "eager_attention_forward", patched)


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("layer", [0, 1])
def test_deepseek_v4_an_edit_at_k_or_v_leaves_the_other_and_the_compressed_entries(deepseek_v4, monkeypatch,
                                                                                    which, layer):
    model, lens = deepseek_v4
    site_name = f"blocks.{layer}.attn.{which}"
    vector = _vector(lens.site(site_name))
    ids = _ids(9)  # 2 compressed entries at block 1 (one per 4 tokens)
    with torch.no_grad(), lens.steer(Add(vector, site=site_name)):
        got = model(input_ids=ids, use_cache=False).logits
    with monkeypatch.context() as patch:
        _manual_attention(patch, which, vector, layer)
        with torch.no_grad():
            expected = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("layer, length, entries", [(1, 9, 2), (0, 130, 1)])  # CSA: 1 per 4 tokens; HCA: per 128
def test_deepseek_v4_reads_are_the_tokens_keys_and_the_full_pattern(deepseek_v4, monkeypatch, layer, length, entries):
    model, lens = deepseek_v4
    assert not lens.adapter.problems
    attn = model.model.layers[layer].self_attn
    seen, original = {}, ds.eager_attention_forward

    def recording(module, query, key, value, *args, **kwargs):
        if module is attn:
            seen["key"] = key.clone()
        return original(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(ds, "eager_attention_forward", recording)
    handle = attn.compressor.register_forward_hook(lambda m, a, out: seen.update(entries=out[0]))
    names = [f"blocks.{layer}.attn.{w}" for w in ("k", "v", "pattern")]
    try:
        cap = Batches()
        with torch.no_grad(), lens.capture(names, keep_shape=True, on_batch=cap):
            out = model(input_ids=_ids(length), use_cache=False, output_attentions=True)
    finally:
        handle.remove()
    acts = cap.acts
    assert seen["entries"].shape[2] == entries and seen["key"].shape[2] == length + entries  # tokens, then entries
    torch.testing.assert_close(seen["key"][:, :, length:], seen["entries"], rtol=0, atol=0)
    for which in "kv":  # the tokens' rows (K = V), not the last T keys
        torch.testing.assert_close(acts[names["kv".index(which)]], seen["key"][:, :, :length].transpose(1, 2),
                                   rtol=0, atol=0)
    pattern = acts[names[2]].transpose(1, 2)
    assert pattern.shape == out.attentions[layer].shape == (2, 4, length, length + entries)
    torch.testing.assert_close(pattern, out.attentions[layer], rtol=0, atol=1e-5)
    assert f"compressor ({type(attn.compressor).__name__})" in lens.site(names[0]).source
    assert "an edit here changes only the keys" in lens.site(names[0]).source
    assert f"blocks.{layer}.cross_attn_out" not in lens.sites  # more keys than queries, but self-attention
    assert "rotary base 160000" in lens.site(f"blocks.{layer}.attn.q").source  # the layer's "compress" rope


def test_deepseek_v4_q_edits_and_patterns_follow_a_cache_and_k_v_refuse_it(deepseek_v4):
    """Its cache stores the tokens' keys twice and the module reads the keys back as values,
    then appends the compressor's entries: k/v hooks cannot follow that, q and pattern can."""
    model, lens = deepseek_v4
    ids, vector = _ids(9), _vector(lens.site("blocks.1.attn.q"), 3) * 3

    def generate(**kwargs):
        with torch.no_grad(), lens.steer(Add(vector, site="blocks.1.attn.q")):
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                 do_sample=False, output_scores=True, return_dict_in_generate=True, **kwargs)
        return out.sequences, torch.stack(out.scores)

    fresh, fresh_scores = generate(use_cache=False)
    cached, cached_scores = generate()
    assert torch.equal(cached, fresh)
    torch.testing.assert_close(cached_scores, fresh_scores, rtol=0, atol=1e-5)
    cap = Batches()
    with torch.no_grad(), lens.capture("blocks.1.attn.pattern", keep_shape=True, on_batch=cap):
        out = model(input_ids=ids, use_cache=True, output_attentions=True)
    torch.testing.assert_close(cap.acts["blocks.1.attn.pattern"].transpose(1, 2), out.attentions[1],
                               rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="attends to other keys/values than it stores"), torch.no_grad(), \
            lens.capture("blocks.1.attn.v", keep_shape=True):
        model(input_ids=ids, use_cache=True)
    assert active_hook_count(lens.hooks) == 0  # nothing stays attached after the refusal
