"""ConceptSet's names: `d` is the directions' width (at a q site H * d_head, not the hidden size)."""

import json

import torch

from conceptlens.concepts.conceptset import ConceptSet


def test_the_width_is_d_and_hidden_size_stays_its_alias(tmp_path):
    cs = ConceptSet(torch.randn(3, 12), site="blocks.0.attn.q")  # a q site: H * d_head, not the hidden size
    assert cs.d == 12 and cs.hidden_size == 12 and "d=12" in repr(cs)
    cs.save(tmp_path / "q")
    again = ConceptSet.load(tmp_path / "q")
    assert again.d == 12 and json.loads((tmp_path / "q" / "config.json").read_text())["hidden_size"] == 12
