"""blocks.i.mlp.in: what a block's MLP reads (a transcoder's or cross-layer transcoder's source).

Checked against HF's own modules: the site equals the block's pre-MLP norm of resid_in + attn_out,
and the block's MLP applied to it gives mlp_out (through the post-MLP norm where the block has one).
"""

from __future__ import annotations

import pytest
import torch

import conceptlens
from tests.conftest import tiny_inputs, tiny_model

# family -> (pre-MLP norm, MLP, post-MLP norm or None), as paths inside HF's block
LAYOUTS = {"llama": ("post_attention_layernorm", "mlp", None),
           "gpt2": ("ln_2", "mlp", None),
           "gemma2": ("pre_feedforward_layernorm", "mlp", "post_feedforward_layernorm")}


@pytest.mark.parametrize("family", LAYOUTS)
def test_mlp_in_is_what_the_mlp_reads(family):
    model = tiny_model(family)
    lens = conceptlens.attach(model)
    norm, mlp, post = LAYOUTS[family]
    sites = [f"blocks.{i}.{s}" for i in range(2) for s in ("resid_in", "attn_out", "mlp.in", "mlp_out")]
    with lens.capture(sites, keep_shape=True) as cap:
        acts, _ = cap.forward(**tiny_inputs(family))
    layers = [m for m in model.modules() if hasattr(m, mlp) and hasattr(m, norm)]
    assert len(layers) == 2
    with torch.no_grad():
        for i, block in enumerate(layers):
            mid = acts[f"blocks.{i}.resid_in"] + acts[f"blocks.{i}.attn_out"]
            torch.testing.assert_close(acts[f"blocks.{i}.mlp.in"], getattr(block, norm)(mid), rtol=1e-4, atol=1e-5)
            out = getattr(block, mlp)(acts[f"blocks.{i}.mlp.in"])
            out = getattr(block, post)(out) if post else out
            torch.testing.assert_close(out, acts[f"blocks.{i}.mlp_out"], rtol=1e-4, atol=1e-5)
    with pytest.raises(KeyError, match="before the norm's weight and bias.*blocks.0.mlp.in is the norm's output"):
        lens.site("blocks.0.ln2.hook_normalized")  # TransformerLens's hook: not this site (before the weight)


def test_no_mlp_in_without_a_separate_mlp_module():
    lens = conceptlens.attach(tiny_model("bert"))  # BERT's MLP is two modules of the block, no container
    assert "blocks.0.mlp.in" not in lens.sites
    assert "blocks.0.mlp_out" in lens.sites
