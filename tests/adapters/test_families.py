"""Every family: sites match HF's own hidden states, and a capturing lens changes nothing."""

from __future__ import annotations

import pytest
import torch

import conceptlens
from tests.adapters.coverage import hidden as _hidden_states
from tests.conftest import ENCODER_DECODERS, Batches, tiny_inputs, tiny_model

# Pre-LN families return the *final norm's output* as their last hidden state; their last
# block's resid_out is the input of that norm. Post-LN families have no final norm.
FINAL_IN_LAST_HIDDEN = {"gpt2", "llama", "mistral", "qwen2", "gemma2", "gpt_neox", "opt", "phi", "t5"}


def test_resid_out_and_embed_match_hidden_states(family):
    model = tiny_model(family)
    lens = conceptlens.attach(model)
    inputs = tiny_inputs(family)
    stacks = ["encoder", "decoder"] if family in ENCODER_DECODERS else [""]
    with torch.no_grad():
        ref = model(**inputs, output_hidden_states=True)
    for stack in stacks:
        p = f"{stack}." if stack else ""
        n = lens.adapter.n_blocks[stack]
        names = [f"{p}embed"] + [f"{p}blocks.{i}.resid_out" for i in range(n)] + \
            ([f"{p}final"] if f"{p}final" in lens.sites else [])
        cap = Batches()
        with lens.capture(names, keep_shape=True, on_batch=cap), torch.no_grad():
            model(**inputs)
        acts, _ = cap[-1]
        hs = _hidden_states(ref, stack)
        assert len(hs) == n + 1
        torch.testing.assert_close(acts[f"{p}embed"], hs[0], rtol=0, atol=0)
        for i in range(n - 1):
            torch.testing.assert_close(acts[f"{p}blocks.{i}.resid_out"], hs[i + 1], rtol=0, atol=0)
        last = f"{p}final" if family in FINAL_IN_LAST_HIDDEN else f"{p}blocks.{n - 1}.resid_out"
        torch.testing.assert_close(acts[last], hs[n], rtol=0, atol=0)
        assert (f"{p}final" in lens.sites) == (family in FINAL_IN_LAST_HIDDEN)


def test_logits_bit_identical_while_capturing_every_site(family):
    model = tiny_model(family)
    inputs = tiny_inputs(family)
    with torch.no_grad():
        bare = model(**inputs).logits
    lens = conceptlens.attach(model)
    stacks = {}
    for site in lens.sites.values():  # one capture per token stream
        stacks.setdefault(site.stack + "|" + site.name.split(".")[0], []).append(site.name)
    seen = [Batches() for _ in stacks]
    captures = [lens.capture(names, keep_shape=True, on_batch=cap) for names, cap in zip(stacks.values(), seen)]
    with torch.no_grad():
        for capture in captures:
            capture.__enter__()
        try:
            logits = model(**inputs).logits
        finally:
            for capture in captures:
                capture.__exit__(None, None, None)
    assert torch.equal(bare, logits)
    for cap in seen:
        acts, _ = cap[-1]
        for name, tensor in acts.items():
            shape = lens.sites[name].shape
            concrete = tuple(tensor.shape)
            assert len(concrete) == len(shape), name
            assert all(isinstance(s, str) or s == c for s, c in zip(shape, concrete)), (name, shape, concrete)


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "t5"])
def test_site_table_and_descriptions(family):
    lens = conceptlens.attach(tiny_model(family))
    p = "decoder." if family in ENCODER_DECODERS else ""
    kinds = ["resid_in", "resid_out", "attn_out", "mlp_out", "attn.q", "attn.k", "attn.v"]
    for i in (0, 1):
        for kind in kinds:
            assert f"{p}blocks.{i}.{kind}" in lens.sites
    assert lens.site(f"{p}blocks.-1.attn.k") is lens.sites[f"{p}blocks.1.attn.k"]
    assert "rotary" in lens.site(f"{p}blocks.0.attn.q").source or family != "llama"
    if family in ENCODER_DECODERS:
        assert "decoder.blocks.0.cross_attn.q" in lens.sites
        assert lens.site("decoder.blocks.0.cross_attn.k").stack == "encoder"


def test_gqa_kv_heads_in_shapes():
    lens = conceptlens.attach(tiny_model("llama"))
    assert lens.site("blocks.0.attn.q").shape == ("B", "T", 4, 8)
    assert lens.site("blocks.0.attn.k").shape == ("B", "T", 2, 8)
    assert lens.site("blocks.0.attn.v").shape == ("B", "T", 2, 8)


def test_deberta_reads_projections_and_says_so():
    lens = conceptlens.attach(tiny_model("deberta-v2"))
    assert "query_proj" in lens.site("blocks.0.attn.q").source


def test_unknown_site_names_close_matches_and_range():
    lens = conceptlens.attach(tiny_model("llama"))
    with pytest.raises(KeyError, match=r"blocks 0-1, e.g. 'blocks.1.resid_out'"):
        lens.site("blocks.40.resid_out")
    with pytest.raises(KeyError, match="close valid names"):
        lens.site("blocks.1.resid_ot")
    with pytest.raises(KeyError, match="blocks 0-1"):
        lens.site("blocks.-3.resid_out")
    with pytest.raises(TypeError):
        lens.site(3)


def test_structural_adapter_finds_blocks_without_a_family_entry():
    model = tiny_model("llama")
    lens = conceptlens.attach(model)
    assert lens.adapter.generic
    assert lens.site("blocks.1.resid_out").module is model.model.layers[1]
    assert lens.site("final").module is model.model.norm
    assert lens.site("blocks.0.attn.k").shape == ("B", "T", 2, 8)
    inputs = tiny_inputs("llama")
    with torch.no_grad():
        ref = model(**inputs, output_hidden_states=True).hidden_states
        cap = Batches()
        with lens.capture(["blocks.0.resid_out"], keep_shape=True, on_batch=cap):
            model(**inputs)
    assert torch.equal(cap.acts["blocks.0.resid_out"], ref[1])
