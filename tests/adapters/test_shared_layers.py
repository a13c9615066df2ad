"""Blocks that are calls of one shared layer (ALBERT): every site acts per call."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import conceptlens
from conceptlens.steering import Add
from tests.adapters import coverage
from tests.adapters.tiny_configs import build, tiny_config
from tests.conftest import Batches

N = 5


@pytest.fixture(scope="module")
def albert():
    config = tiny_config("albert")
    config.num_hidden_groups, config.num_hidden_layers = 1, N  # one layer run N times, as in real ALBERT
    torch.manual_seed(0)
    model = tf.AlbertForMaskedLM._from_config(config, attn_implementation="eager").eval()
    inputs = coverage.inputs_for(model)
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
    return model, inputs, out


def _resid(lens, model, inputs):
    names = [f"blocks.{i}.{k}" for i in range(N) for k in ("resid_in", "resid_out", "attn_out", "mlp_out")]
    return coverage.capture_all(lens, model, inputs, names)


def test_every_call_is_a_block(albert):
    model, inputs, out = albert
    layer = model.albert.encoder.albert_layer_groups[0].albert_layers[0]
    hooks = (dict(layer._forward_pre_hooks), dict(layer._forward_hooks))
    lens = conceptlens.attach(model)
    assert lens.adapter.n_blocks[""] == N and all(b is layer for b in lens.adapter.blocks[""])
    acts = _resid(lens, model, inputs)
    for i in range(N):
        assert torch.equal(acts[f"blocks.{i}.resid_out"], out.hidden_states[i + 1])
        assert torch.equal(acts[f"blocks.{i}.resid_in"], out.hidden_states[i])
    coverage.check_model(model, inputs, out)
    coverage.check_attention(model, inputs)  # q/k of each call reproduce that layer's eager weights
    assert "call 3 of this shared AlbertLayer" in lens.site("blocks.3.mlp_out").source
    assert not lens.hooks.counters and (dict(layer._forward_pre_hooks), dict(layer._forward_hooks)) == hooks


@pytest.mark.parametrize("site", ["blocks.3.mlp_out", "blocks.3.resid_in", "blocks.3.attn.v"])
def test_edit_at_one_call_changes_only_what_follows(albert, site):
    model, inputs, _ = albert
    lens = conceptlens.attach(model)
    before = _resid(lens, model, inputs)
    width = lens.site(site).shape[-1] * (lens.site(site).shape[-2] if site.endswith(".v") else 1)
    with lens.steer(Add(torch.ones(width), 3.0, site=site)):
        after = _resid(lens, model, inputs)
    for i in range(N):
        for kind in ("resid_in", "resid_out"):
            name = f"blocks.{i}.{kind}"
            unchanged = i < 3 or (i == 3 and kind == "resid_in" and site != "blocks.3.resid_in")
            assert torch.equal(before[name], after[name]) == unchanged, name
    if site == "blocks.3.mlp_out":  # the edit itself is seen by a read at the same site (edits before reads)
        assert torch.allclose(after["blocks.3.mlp_out"], before["blocks.3.mlp_out"] + 3.0, atol=1e-5)
    assert not lens.hooks.counters


def test_stop_early_and_counter_reset(albert):
    model, inputs, out = albert
    lens = conceptlens.attach(model)
    layer = lens.adapter.blocks[""][0]
    ran = []
    handle = layer.register_forward_hook(lambda *a: ran.append(1))
    try:
        seen = Batches()
        with lens.capture(["blocks.1.resid_out"], on_batch=seen) as cap:
            for _ in range(2):  # the count restarts at every forward, also after a stopped one
                ran.clear()
                acts, _ = cap.forward(**inputs)
                assert len(ran) == 2  # stopped after the second call: nothing later ran
                assert torch.equal(acts["blocks.1.resid_out"], out.hidden_states[2].flatten(0, 1))
            with torch.no_grad():
                model(**inputs)  # a full forward inside the same capture: still call 1
            assert len(seen) == 3 and torch.equal(seen.acts["blocks.1.resid_out"], out.hidden_states[2].flatten(0, 1))
    finally:
        handle.remove()
    assert not lens.hooks.counters


def test_module_path_of_a_shared_layer_is_ambiguous(albert):
    model, _, _ = albert
    lens = conceptlens.attach(model)
    with pytest.raises(KeyError):
        lens.site("albert.encoder.albert_layer_groups.0.albert_layers.0")
    assert lens.site_name("blocks.2.hook_resid_post") == "blocks.2.resid_out"


def test_looped_layers_under_generate():
    """HRM runs its L and H layers in cycles: each generate step restarts the call count, so a
    read at one virtual block gives that block's hidden state at every step, and an edit there
    changes the logits. (transformers' own cached generate fails on a tiny HRM: no cache here.)"""
    model = build("hrm_text")
    lens = conceptlens.attach(model)
    n = lens.adapter.n_blocks[""]
    with torch.no_grad():
        assert n + 1 == len(model(torch.tensor([[5, 6]]), output_hidden_states=True, use_cache=False).hidden_states)
    assert len(set(map(id, lens.adapter.blocks[""]))) < n  # fewer layer modules than blocks
    ids = torch.randint(4, 100, (1, 5), generator=torch.Generator().manual_seed(0))
    site, steps = f"blocks.{n // 2}.resid_out", []
    kwargs = dict(max_new_tokens=3, do_sample=False, use_cache=False, pad_token_id=0)
    with torch.no_grad(), lens.capture(site, on_batch=lambda a, m: steps.append(a[site])):
        tokens = model.generate(ids, **kwargs)
    assert len(steps) == 3
    for s, got in enumerate(steps):
        with torch.no_grad():
            ref = model(tokens[:, : 5 + s], output_hidden_states=True, use_cache=False).hidden_states[n // 2 + 1]
        assert torch.allclose(got, ref[0], atol=1e-6), s
    vector = torch.randn(64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        bare = model(tokens, use_cache=False).logits
        with lens.steer(Add(vector, 20.0, site=site)):
            edited = model(tokens, use_cache=False).logits
            again = model(tokens, use_cache=False).logits  # the count restarted: the same edit again
    assert not torch.allclose(edited, bare) and torch.equal(edited, again) and not lens.hooks.counters


@pytest.mark.parametrize("groups,inner,layers", [(1, 2, 3), (2, 2, 4), (2, 1, 4)])
def test_albert_groups_of_several_layers(groups, inner, layers):
    """Several layers per group, several groups: block i is the i-th layer call, in HF's order."""
    config = tiny_config("albert")
    config.num_hidden_groups, config.inner_group_num, config.num_hidden_layers = groups, inner, layers
    torch.manual_seed(0)
    model = tf.AlbertForMaskedLM._from_config(config, attn_implementation="eager").eval()
    inputs = coverage.inputs_for(model)
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
    lens = conceptlens.attach(model)
    n = layers * inner
    assert lens.adapter.n_blocks[""] == n == len(out.hidden_states) - 1
    coverage.check_model(model, inputs, out)
    coverage.check_attention(model, inputs)
    # an edit at the last block's first call of a layer changes that call's output and nothing before it
    site = f"blocks.{n - 2}.mlp_out"
    names = [f"blocks.{i}.resid_out" for i in range(n)]
    before = coverage.capture_all(lens, model, inputs, names)
    with lens.steer(Add(torch.ones(lens.site(site).shape[-1]), 2.0, site=site)):
        after = coverage.capture_all(lens, model, inputs, names)
    assert [torch.equal(before[k], after[k]) for k in names] == [True] * (n - 2) + [False, False]
    assert not lens.hooks.counters


@pytest.mark.parametrize("model_type", ["zamba", "zamba2"])
@pytest.mark.parametrize("site", ["blocks.2.attn.v", "blocks.2.attn_out", "blocks.1.attn.q"])
def test_shared_transformer_under_cached_generate(model_type, site):
    """Zamba's hybrid layers call one shared transformer: an edit at one call acts on that call
    only, and cached generation equals uncached generation under it."""
    model = build(model_type)
    lens = conceptlens.attach(model)
    inputs = coverage.inputs_for(model)
    names = [f"blocks.{i}.resid_out" for i in range(3)]
    before = coverage.capture_all(lens, model, inputs, names)
    shape = lens.site(site).shape
    width = shape[-1] * (shape[-2] if site.endswith((".q", ".v")) else 1)
    edit = Add(torch.ones(width), 2.0, site=site)
    with lens.steer(edit):
        after = coverage.capture_all(lens, model, inputs, names)
    block = int(site.split(".")[1])
    assert [torch.equal(before[k], after[k]) for k in names] == [i < block for i in range(3)]
    ids = inputs["input_ids"][:1]
    runs = {}
    for cached in (True, False):
        with lens.steer(edit), torch.no_grad():
            runs[cached] = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=cached,
                                          output_logits=True, return_dict_in_generate=True)
    assert torch.equal(runs[True].sequences, runs[False].sequences)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(runs[True].logits, runs[False].logits))
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert not torch.equal(plain.logits[0], runs[True].logits[0])  # the edit acts
