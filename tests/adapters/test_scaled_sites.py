"""Blocks that scale their sublayers (residual multipliers) or add the residual inside a
sublayer: attn_out / mlp_out are the quantities actually added to the residual, and edits at
them act on the residual exactly."""

from __future__ import annotations

import pytest
import torch

import conceptlens
from conceptlens.steering import Add
import transformers as tf

from tests.adapters.tiny_configs import build, tiny_config
from tests.conftest import Batches


def _model(model_type):
    if not model_type.startswith("granite"):
        return build(model_type)
    config = tiny_config(model_type)
    config.residual_multiplier = 0.25  # the default, 1.0, would not scale
    cls = {"granite": tf.GraniteForCausalLM, "granitemoeshared": tf.GraniteMoeSharedForCausalLM}[model_type]
    torch.manual_seed(0)
    return cls._from_config(config, attn_implementation="eager").eval()


@pytest.mark.parametrize("model_type, note", [("minicpm3", "times 0.989949"), ("granite", "times 0.25,"),
                                              ("mpt", "ffn adds the residual inside itself"),
                                              ("granitemoeshared", "plus the output of block_sparse_moe"),
                                              ("inkling_text", "mlp_sconv is applied to the output of mlp")])
def test_an_add_at_the_last_mlp_out_moves_resid_out_by_exactly_the_vector(model_type, note):
    model = _model(model_type)
    lens = conceptlens.attach(model)
    assert not lens.adapter.problems
    site, out = "blocks.1.mlp_out", "blocks.1.resid_out"
    assert note in lens.site(site).source
    ids = torch.randint(4, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    vector = torch.randn(lens.site(site).width, generator=torch.Generator().manual_seed(1))
    bare = Batches()
    with torch.no_grad(), lens.capture([site, out], keep_shape=True, on_batch=bare):
        logits = model(input_ids=ids).logits
    cap = Batches()
    with torch.no_grad(), lens.steer(Add(vector, site=site)), lens.capture([site, out], keep_shape=True, on_batch=cap):
        model(input_ids=ids)
    torch.testing.assert_close(cap.acts[site], bare.acts[site] + vector, rtol=0, atol=1e-5)
    torch.testing.assert_close(cap.acts[out], bare.acts[out] + vector, rtol=0, atol=1e-5)
    with torch.no_grad(), lens.steer(Add(vector, 0.0, site=site)):
        assert torch.equal(model(input_ids=ids).logits, logits)  # a null edit is bit-identical
