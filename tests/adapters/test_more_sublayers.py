"""Blocks with more sublayers than one attention and one MLP: Gemma 4's per-layer-input branch
(`branch_out`) and LongCat-Flash's two attention / MLP pairs plus a shortcut MoE (summed
`attn_out` / `mlp_out`, a second attention's `attn_1.*` sites). Reads equal the tensors taken
with manual hooks on the HF modules; edits equal the same change made by a manual hook."""

from __future__ import annotations

import pytest
import torch

import conceptlens
from conceptlens.steering import Add
import transformers as tf

from tests.adapters import coverage
from tests.adapters.tiny_configs import build, tiny_config
from tests.conftest import Batches

IDS = torch.randint(4, 100, (2, 6), generator=torch.Generator().manual_seed(0))


def _capture_with(lens, model, names, modules):
    """(the sites `names` captured in one forward, each of `modules`' (first) output in that forward)."""
    store, handles = {}, []
    for key, module in modules.items():
        def hook(m, args, output, key=key):
            store[key] = (output[0] if isinstance(output, tuple) else output).detach().clone()
        handles.append(module.register_forward_hook(hook))
    try:
        cap = Batches()
        with torch.no_grad(), lens.capture(names, keep_shape=True, on_batch=cap):
            model(input_ids=IDS)
    finally:
        for h in handles:
            h.remove()
    return cap.acts, store


def _manual_add(module, vector):
    def hook(m, args, output):
        if isinstance(output, tuple):
            return (output[0] + vector, *output[1:])
        return output + vector
    return module.register_forward_hook(hook)


def _edit_matches_manual_hook(model, lens, site, module):
    vector = torch.randn(lens.site(site).width, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        bare = model(input_ids=IDS).logits
        handle = _manual_add(module, vector)
        try:
            manual = model(input_ids=IDS).logits
        finally:
            handle.remove()
        with lens.steer(Add(vector, site=site)):
            steered = model(input_ids=IDS).logits
        with lens.steer(Add(vector, 0.0, site=site)):
            null = model(input_ids=IDS).logits
    assert not torch.allclose(manual, bare, atol=1e-4)  # the edit matters
    torch.testing.assert_close(steered, manual, rtol=0, atol=1e-6)
    assert torch.equal(null, bare)  # a null edit is bit-identical


@pytest.fixture(scope="module")
def gemma4():
    model = build("gemma4_text")
    return model, conceptlens.attach(model)


@pytest.fixture(scope="module")
def longcat():
    model = build("longcat_flash")
    return model, conceptlens.attach(model)


def test_gemma4_branch_out_is_the_per_layer_input_branch(gemma4):
    model, lens = gemma4
    assert not lens.adapter.problems
    layers = model.model.layers
    names = [f"blocks.{i}.{k}" for i in range(2) for k in ("resid_in", "attn_out", "mlp_out", "branch_out", "resid_out")]
    acts, store = _capture_with(lens, model, names, {i: layers[i].post_per_layer_input_norm for i in range(2)})
    for i in range(2):
        assert "further branch" in lens.site(f"blocks.{i}.branch_out").source
        assert lens.site(f"blocks.{i}.branch_out").module is layers[i].post_per_layer_input_norm
        assert torch.equal(acts[f"blocks.{i}.branch_out"], store[i])
        total = sum(acts[f"blocks.{i}.{k}"] for k in ("resid_in", "attn_out", "mlp_out", "branch_out"))
        torch.testing.assert_close(total, acts[f"blocks.{i}.resid_out"], rtol=0, atol=1e-4)


def test_gemma4_an_edit_at_branch_out_is_a_hook_on_the_branch(gemma4):
    model, lens = gemma4
    _edit_matches_manual_hook(model, lens, "blocks.0.branch_out", model.model.layers[0].post_per_layer_input_norm)


def test_gemma4_moe_layers_read_mlp_out_after_the_norm_of_dense_mlp_and_experts():
    config = tiny_config("gemma4_text")
    config.enable_moe_block, config.num_experts, config.top_k_experts = True, 4, 2
    torch.manual_seed(0)
    model = tf.Gemma4ForCausalLM._from_config(config, attn_implementation="eager").eval()
    inputs = {**coverage.inputs_for(model), "use_cache": False}
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
    coverage.check_model(model, inputs, out)  # no problems; resid_in + attn + mlp + branch == resid_out
    lens = conceptlens.attach(model)
    layer = model.model.layers[1]
    assert lens.site("blocks.1.mlp_out").module is layer.post_feedforward_layernorm
    _edit_matches_manual_hook(model, lens, "blocks.1.mlp_out", layer.post_feedforward_layernorm)


def test_gemma4_with_shared_kv_layers_passes_every_check():
    config = tiny_config("gemma4_text").to_dict()
    config.update(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                  num_kv_shared_layers=2, per_layer_config={"1": {"head_dim": 32}, "3": {"head_dim": 32}})
    torch.manual_seed(0)
    model = tf.Gemma4ForCausalLM._from_config(tf.Gemma4TextConfig(**config), attn_implementation="eager").eval()
    assert [layer.self_attn.is_kv_shared_layer for layer in model.model.layers] == [False, False, True, True]
    inputs = {**coverage.inputs_for(model), "use_cache": False}
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
    coverage.check_model(model, inputs, out)
    coverage.check_attention(model, inputs)
    coverage.check_kv_cache(model, inputs)


def test_gemma4_a_layer_scalar_other_than_one_is_the_detected_residual_coefficient():
    model = build("gemma4_text")
    for layer in model.model.layers:
        layer.layer_scalar.fill_(0.5)  # out = 0.5 * (resid + attn + mlp + branch): not resid + their sum
    lens = conceptlens.attach(model)
    assert not lens.adapter.problems
    kinds = ("attn_out", "mlp_out", "branch_out")
    names = [f"blocks.{i}.{k}" for i in range(2) for k in ("resid_in", "resid_out") + kinds]
    acts, store = _capture_with(lens, model, names, {i: model.model.layers[i].post_per_layer_input_norm for i in range(2)})
    for i in range(2):
        lay = lens.adapter.layout("", i)
        assert abs(lay.resid_coef - 0.5) < 1e-6 and "0.5 * resid_in" in lens.site(f"blocks.{i}.resid_out").source
        assert "branch_out" in lens.site(f"blocks.{i}.resid_out").source
        torch.testing.assert_close(acts[f"blocks.{i}.branch_out"], 0.5 * store[i], rtol=0, atol=1e-6)
        total = lay.resid_coef * acts[f"blocks.{i}.resid_in"] + sum(acts[f"blocks.{i}.{k}"] for k in kinds)
        torch.testing.assert_close(total, acts[f"blocks.{i}.resid_out"], rtol=0, atol=1e-4)
    vector = torch.randn(64, generator=torch.Generator().manual_seed(1))
    bare = Batches()
    with torch.no_grad(), lens.capture(["blocks.1.resid_out"], keep_shape=True, on_batch=bare):
        model(input_ids=IDS)
    cap = Batches()
    with torch.no_grad(), lens.steer(Add(vector, site="blocks.1.branch_out")), \
            lens.capture(["blocks.1.resid_out"], keep_shape=True, on_batch=cap):
        model(input_ids=IDS)
    torch.testing.assert_close(cap.acts["blocks.1.resid_out"], bare.acts["blocks.1.resid_out"] + vector,
                               rtol=0, atol=1e-5)  # the edit moves the residual by exactly its change


def test_longcat_sums_its_attention_and_mlp_sublayers(longcat):
    model, lens = longcat
    assert not lens.adapter.problems
    layers = model.model.layers
    modules = {}
    for i in range(2):
        modules.update({(i, "a0"): layers[i].self_attn[0], (i, "a1"): layers[i].self_attn[1],
                        (i, "m0"): layers[i].mlps[0], (i, "m1"): layers[i].mlps[1], (i, "moe"): layers[i].mlp})
    names = [f"blocks.{i}.{k}" for i in range(2) for k in ("attn_out", "mlp_out")]
    acts, store = _capture_with(lens, model, names, modules)
    for i in range(2):
        torch.testing.assert_close(acts[f"blocks.{i}.attn_out"], store[i, "a0"] + store[i, "a1"], rtol=0, atol=1e-6)
        torch.testing.assert_close(acts[f"blocks.{i}.mlp_out"], store[i, "moe"] + store[i, "m0"] + store[i, "m1"],
                                   rtol=0, atol=1e-6)
        assert "sum of the block's 2 attention sublayers" in lens.site(f"blocks.{i}.attn_out").source
    with pytest.raises(KeyError):  # the HF path of one sublayer is not the summed site
        lens.site("model.layers.0.self_attn.1")


@pytest.mark.parametrize("site, path", [("blocks.0.attn_out", "self_attn.1"), ("blocks.1.mlp_out", "mlps.1")])
def test_longcat_an_edit_at_a_summed_site_is_a_hook_on_its_last_sublayer(longcat, site, path):
    model, lens = longcat
    _edit_matches_manual_hook(model, lens, site, model.model.layers[int(site.split(".")[1])].get_submodule(path))


def test_longcat_each_attention_sublayer_has_its_pattern(longcat):
    model, lens = longcat
    names = [f"blocks.{i}.{a}.pattern" for i in range(2) for a in ("attn", "attn_1")]
    assert lens.site("blocks.1.attn_1.q").module is model.model.layers[1].self_attn[1]
    cap = Batches()
    with torch.no_grad(), lens.capture(names, keep_shape=True, on_batch=cap):
        out = model(input_ids=IDS, output_attentions=True, use_cache=False)
    assert len(out.attentions) == 4  # HF lists both attentions of each layer, in order
    for name, ref in zip(names, out.attentions):
        torch.testing.assert_close(cap.acts[name].transpose(1, 2), ref, rtol=0, atol=1e-5)


def test_longcat_second_attention_kv_refuses_a_cache(longcat):
    model, lens = longcat
    with pytest.raises(ValueError, match="attends to other keys/values than it stores"), torch.no_grad(), \
            lens.capture(["blocks.0.attn_1.k"], keep_shape=True):
        model(input_ids=IDS, use_cache=True)


def test_a_shared_mlp_beside_the_experts_is_read_once_in_the_summed_mlp_out():
    config = tiny_config("granitemoeshared")
    config.residual_multiplier = 0.25
    torch.manual_seed(0)
    model = tf.GraniteMoeSharedForCausalLM._from_config(config, attn_implementation="eager").eval()
    lens = conceptlens.attach(model)
    layer = model.model.layers[1]
    assert "blocks.1.branch_out" not in lens.sites
    acts, store = _capture_with(lens, model, ["blocks.1.mlp_out"], {"moe": layer.block_sparse_moe, "shared": layer.shared_mlp})
    torch.testing.assert_close(acts["blocks.1.mlp_out"], 0.25 * (store["moe"] + store["shared"]),
                               rtol=0, atol=1e-6)


def test_longcat_second_attention_z_is_its_pattern_times_its_v(longcat):
    model, lens = longcat
    names = ["blocks.1.attn_1.pattern", "blocks.1.attn_1.v", "blocks.1.attn_1.z"]
    seen = {}
    handle = model.model.layers[1].self_attn[1].o_proj.register_forward_pre_hook(
        lambda m, args: seen.update(z=args[0].detach().clone()))
    try:
        cap = Batches()
        with torch.no_grad(), lens.capture(names, keep_shape=True, on_batch=cap):
            model(input_ids=IDS, use_cache=False)
    finally:
        handle.remove()
    pattern, v, z = (cap.acts[n] for n in names)  # (B, T, H, S), (B, S, H, d), (B, T, H, d)
    torch.testing.assert_close(z.flatten(-2), seen["z"], rtol=0, atol=0)
    torch.testing.assert_close(torch.einsum("bths,bshd->bthd", pattern, v), z, rtol=0, atol=1e-5)
