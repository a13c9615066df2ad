"""Blocks made from parallel ModuleLists (XLM, FlauBERT): layer i is index i of each list."""

from __future__ import annotations

import torch

import conceptlens
from conceptlens.sites.views import TimeMajor
from conceptlens.steering import Add
from tests.adapters import coverage
from tests.adapters.tiny_configs import build


def test_xlm_blocks_are_list_indices_and_edits_stay_local():
    model = build("xlm")
    lens = conceptlens.attach(model)
    assert lens.site("blocks.1.attn_out").module is model.transformer.attentions[1]
    assert lens.site("blocks.1.resid_out").module is model.transformer.layer_norm2[1]
    assert lens.site_name("transformer.ffns.0") == "blocks.0.mlp_out"
    inputs = coverage.inputs_for(model)
    inputs["attention_mask"] = torch.tensor([[0, 1, 1, 1, 1, 1], [1] * 6])
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
    names = ["blocks.0.resid_out", "blocks.1.resid_in", "blocks.1.resid_out"]
    acts = coverage.capture_all(lens, model, inputs, names)
    keep = inputs["attention_mask"].bool()
    assert torch.equal(acts["blocks.0.resid_out"][keep], out.hidden_states[1][keep])
    assert torch.equal(acts["blocks.1.resid_out"][keep], out.hidden_states[2][keep])
    with lens.steer(Add(torch.ones(64), 2.0, site="blocks.1.attn_out")):
        edited = coverage.capture_all(lens, model, inputs, names)
    assert torch.equal(edited["blocks.1.resid_in"], acts["blocks.1.resid_in"])
    assert not torch.equal(edited["blocks.1.resid_out"][keep], acts["blocks.1.resid_out"][keep])



def test_time_major_blocks_fsmt():
    model = build("fsmt")
    lens = conceptlens.attach(model)
    inputs = coverage.inputs_for(model)
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True, use_cache=False)
    names = ["encoder.blocks.0.resid_out", "encoder.blocks.1.resid_in", "encoder.blocks.1.resid_out"]
    acts = coverage.capture_all(lens, model, {**inputs, "use_cache": False}, names)
    assert acts["encoder.blocks.0.resid_out"].shape == (2, 6, 64)  # (B, T, d), not the modules' (T, B, d)
    assert torch.equal(acts["encoder.blocks.1.resid_out"], out.encoder_hidden_states[2])
    vector = torch.arange(64.0)
    with lens.steer(Add(vector, 1.0, site="encoder.blocks.0.resid_out"), positions=slice(2, 3)):
        edited = coverage.capture_all(lens, model, {**inputs, "use_cache": False}, names)
    change = edited["encoder.blocks.1.resid_in"] - acts["encoder.blocks.1.resid_in"]
    assert torch.allclose(change[:, 2], vector.expand(2, 64), atol=1e-5)  # only position 2 of each row
    assert torch.equal(change[:, :2], torch.zeros_like(change[:, :2])) and not change[:, 3:].any()
    decoder_k = [n for n in lens.sites if n.startswith("decoder.") and n.endswith(".attn.k")]
    assert decoder_k and lens.site(decoder_k[0]).find(TimeMajor)


def test_longformer_sites_are_the_tokens_before_its_window_padding():
    model = build("longformer")
    lens = conceptlens.attach(model)
    inputs = coverage.inputs_for(model)
    inputs["attention_mask"] = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
    names = ["blocks.0.resid_in", "blocks.0.resid_out", "blocks.1.resid_out", "blocks.0.attn.q", "blocks.0.attn_out"]
    acts = coverage.capture_all(lens, model, inputs, names)
    assert acts["blocks.0.resid_out"].shape == (2, 6, 64)  # this forward's 6 tokens, not the window's 512
    assert torch.equal(acts["blocks.1.resid_out"], out.hidden_states[2])
    attention = model.longformer.encoder.layer[0].attention.self
    with torch.no_grad():
        q = attention.query(out.hidden_states[0])
    assert torch.allclose(acts["blocks.0.attn.q"], q.view(2, 6, *acts["blocks.0.attn.q"].shape[2:]), atol=1e-6)
    flat = {}
    with lens.capture(["blocks.0.attn_out"], on_batch=lambda a, m: flat.update(a, meta=m)), torch.no_grad():
        model(**inputs)
    assert flat["blocks.0.attn_out"].shape[0] == 10  # padding of the batch dropped, the model's own never read
    with lens.steer(Add(torch.ones(64), 1.0, site="blocks.0.resid_out"), positions=slice(0, 2)):
        edited = coverage.capture_all(lens, model, inputs, names)
    change = edited["blocks.0.resid_out"] - acts["blocks.0.resid_out"]
    assert torch.allclose(change[:, :2], torch.ones(2, 2, 64)) and not change[:, 2:].any()
