"""Blocks made from parallel ModuleLists (XLM, FlauBERT): layer i is index i of each list."""

from __future__ import annotations

import torch

import conceptlens
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

