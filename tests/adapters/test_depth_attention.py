"""Inkling 2 (attention residuals): each sublayer reads an attention over earlier layers' states
and the residual; at a block boundary the block starts a new sum (resid_out = attn_out + mlp_out)
and the last hidden state mixes the block states before the final norm. Every site is the model's
tensor and edits act as plain torch hooks on the same modules do."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import conceptlens
from conceptlens.steering import Add
from tests.adapters import coverage
from tests.adapters.tiny_configs import build, tiny_config
from tests.conftest import Batches


@pytest.fixture(scope="module")
def inkling2():
    model = build("inkling2_text")
    return model, conceptlens.attach(model)


def _ids():
    return torch.randint(4, 100, (2, 6), generator=torch.Generator().manual_seed(0))


def test_a_boundary_block_restarts_its_sum_and_final_is_the_last_hidden_state(inkling2):
    model, lens = inkling2
    assert not lens.adapter.problems
    assert [lens.adapter.layout("", i).resid_coef for i in range(2)] == [0.0, 1.0]  # layer 0 is a block boundary
    names = [f"blocks.{i}.{k}" for i in range(2) for k in ("resid_in", "attn_out", "mlp_out", "resid_out")]
    cap = Batches()
    with torch.no_grad(), lens.capture(names + ["final"], keep_shape=True, on_batch=cap):
        out = model(input_ids=_ids(), output_hidden_states=True)
    acts = cap.acts
    torch.testing.assert_close(acts["blocks.0.attn_out"] + acts["blocks.0.mlp_out"], acts["blocks.0.resid_out"])
    with_input = acts["blocks.0.resid_in"] + acts["blocks.0.attn_out"] + acts["blocks.0.mlp_out"]
    assert not torch.allclose(with_input, acts["blocks.0.resid_out"], atol=1e-2)  # the input is not carried
    torch.testing.assert_close(acts["blocks.1.resid_in"] + acts["blocks.1.attn_out"] + acts["blocks.1.mlp_out"],
                               acts["blocks.1.resid_out"])
    assert torch.equal(acts["blocks.0.resid_out"], out.hidden_states[1])
    assert torch.equal(acts["final"], out.hidden_states[2])  # final_input's mix of the block states, normed
    assert "does not add its input" in lens.site("blocks.0.resid_out").source


def test_the_pattern_includes_the_per_query_sinks_as_eager_attention_does(inkling2):
    model, lens = inkling2
    names = ["blocks.0.attn.pattern", "blocks.1.attn.pattern"]
    cap = Batches()
    with torch.no_grad(), lens.capture(names, keep_shape=True, on_batch=cap):
        out = model(input_ids=_ids(), output_attentions=True)
    for i, name in enumerate(names):
        got = cap.acts[name].transpose(1, 2)
        assert bool((got.sum(-1) < 1).all())  # the sink took some mass
        torch.testing.assert_close(got, out.attentions[i], rtol=0, atol=1e-6)


def _logits(model, ids, hooks=()):
    handles = [register(fn) for register, fn in hooks]
    try:
        with torch.no_grad():
            return model(input_ids=ids).logits
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("site, module", [("blocks.0.attn_out", "post_attention_convolution"),
                                          ("blocks.1.mlp_out", "post_mlp_convolution")])
def test_an_add_at_a_sublayer_equals_the_same_torch_hook(inkling2, site, module):
    model, lens = inkling2
    ids, vector = _ids(), torch.randn(64, generator=torch.Generator().manual_seed(1))
    target = getattr(model.model.layers[int(site.split(".")[1])], module)
    expected = _logits(model, ids, [(target.register_forward_hook, lambda m, a, o: o + vector)])
    with lens.steer(Add(vector, site=site)):
        got = _logits(model, ids)
    assert not torch.allclose(got, _logits(model, ids), atol=1e-3)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_an_edit_at_a_stored_block_input_reaches_that_block_only_as_its_description_says(inkling2):
    model, lens = inkling2
    site = lens.site("blocks.0.resid_in")
    assert "blocks.1 also attends over this tensor" in site.source and "changes this block only" in site.source
    ids, vector = _ids(), torch.randn(64, generator=torch.Generator().manual_seed(2))
    layer0, embed = model.model.layers[0], model.model.embed_tokens
    as_pre_hook = _logits(model, ids, [(layer0.register_forward_pre_hook, lambda m, a: (a[0] + vector, *a[1:]))])
    at_embedding = _logits(model, ids, [(embed.register_forward_hook, lambda m, a, o: o + vector)])
    with lens.steer(Add(vector, site="blocks.0.resid_in")):
        got = _logits(model, ids)
    torch.testing.assert_close(got, as_pre_hook, rtol=0, atol=1e-6)
    assert not torch.allclose(got, at_embedding, atol=1e-4)  # block 1's depth attention kept the unedited input


def test_looped_layers_with_messages_give_every_site_exactly():
    config = tiny_config("inkling2_loop_text")
    config.num_hidden_layers, config.layer_types = 4, ["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"]
    config.loop_layer_index_start, config.loop_layer_index_end, config.loop_num_passes = 1, 3, 2
    config.n_layers_per_attn_res_block = 2
    torch.manual_seed(0)
    model = tf.Inkling2LoopForCausalLM._from_config(config, attn_implementation="eager").eval()
    inputs = coverage.inputs_for(model)
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True, use_cache=False)
    lens = conceptlens.attach(model)
    assert lens.adapter.n_blocks[""] == 6  # layers 1-2 run twice: blocks 0, 1, 2, 1', 2', 3
    assert [lens.adapter.layout("", i).resid_coef for i in range(6)] == [0.0, 1.0] * 3
    coverage.check_model(model, {**inputs, "use_cache": False}, out)
    coverage.check_attention(model, inputs)
    coverage.check_kv_cache(model, inputs)


def test_a_later_boundary_keeps_its_input_as_a_state_as_the_description_says():
    config = tiny_config("inkling2_text")
    config.num_hidden_layers, config.layer_types = 4, ["hybrid_sliding", "hybrid"] * 2
    config.n_layers_per_attn_res_block = 2  # layers 0 and 2 start a block
    torch.manual_seed(0)
    model = tf.Inkling2ForCausalLM._from_config(config, attn_implementation="eager").eval()
    lens = conceptlens.attach(model)
    assert "edit blocks.1.resid_out to change both" in lens.site("blocks.2.resid_in").source
    ids, vector = _ids(), torch.randn(64, generator=torch.Generator().manual_seed(3))
    states = {}
    hook = model.model.layers[3].register_forward_pre_hook(lambda m, a: states.update(kept=a[1][..., -1, :]))
    try:
        for site in ("blocks.1.resid_out", "blocks.2.resid_in"):
            cap = Batches()
            with torch.no_grad(), lens.steer(Add(vector, site=site)), \
                    lens.capture(["blocks.2.resid_in"], keep_shape=True, on_batch=cap):
                model(input_ids=ids)
            # the state block 3 attends over is block 2's input only when the edit came before the stack kept it
            assert torch.equal(states["kept"], cap.acts["blocks.2.resid_in"]) == (site == "blocks.1.resid_out")
    finally:
        hook.remove()
