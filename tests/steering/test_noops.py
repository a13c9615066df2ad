"""Edits that provably change nothing are named in one warning; edits that act are not."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import transformers as tf

import conceptlens
from conceptlens.steering import Ablate, Add, ProjectOut
from tests.adapters import coverage
from tests.conftest import CONFIGS, tiny_model

IDS = torch.randint(3, 99, (2, 9), generator=torch.Generator().manual_seed(4))


def steered_logits(lens, edit, positions="all") -> tuple[torch.Tensor, list[str]]:
    """Logits of IDS under `edit`, and the messages of the warnings building the scope raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scope = lens.steer(edit, positions=positions)
    with torch.no_grad(), scope:
        logits = lens.model(IDS).logits
    return logits, [str(w.message) for w in caught]


def width(site) -> int:
    return math.prod(int(s) for s in site.shape[2:])


def test_a_constant_shift_of_every_key_is_named_and_indeed_changes_nothing():
    lens = conceptlens.attach(tiny_model("llama"))
    with torch.no_grad():
        clean = lens.model(IDS).logits
    for site, positions in (("blocks.0.attn.k", "all"), ("blocks.0.attn.k", slice(0, None)),
                            ("blocks.0.attn.k", slice(1, None)), ("blocks.0.attn.q", "all")):
        v = 50 * torch.randn(width(lens.site(site)), generator=torch.Generator().manual_seed(1))
        logits, messages = steered_logits(lens, Add(v, 1.0, site=site), positions)
        if site.endswith(".k") and positions != slice(1, None):
            assert len(messages) == 1 and "blocks.0.attn.k on every position" in messages[0] and \
                "cancels" in messages[0]
            torch.testing.assert_close(logits, clean, atol=1e-4, rtol=0)  # it does change nothing
        else:
            assert messages == [], (site, positions)
            assert float((logits - clean).abs().max()) > 1e-2, (site, positions)


def test_a_projection_orthogonal_to_every_activation_is_named():
    model = tiny_model("llama")
    with torch.no_grad():  # coordinate 5 of the residual stream stays 0: nothing writes it
        model.get_input_embeddings().weight[:, 5] = 0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[5] = 0
            layer.mlp.down_proj.weight[5] = 0
    lens = conceptlens.attach(model)
    axis = torch.zeros(32)
    axis[5] = 1.0
    for edit in (ProjectOut(axis, site="blocks.1.resid_out"), Ablate(axis, "mean", mean=torch.ones(32),
                                                                     site="blocks.1.resid_out")):
        _, messages = steered_logits(lens, edit)
        assert len(messages) == 1 and "no component along these directions" in messages[0]
        assert messages[0].startswith(f"{type(edit).__name__} at blocks.1.resid_out")
    general = torch.randn(32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        clean = lens.model(IDS).logits
    logits, messages = steered_logits(lens, ProjectOut(general, site="blocks.1.resid_out"))
    assert messages == [] and float((logits - clean).abs().max()) > 1e-3
    _, messages = steered_logits(lens, Ablate(axis, "zero", site="blocks.1.resid_out"))
    assert messages == []  # zeroing is about the site, not the directions


@pytest.mark.parametrize("family", ["gemma2-softcap", "gpt_oss"])
def test_softcapped_scores_or_a_sink_logit_keep_a_key_shift_from_cancelling(family):
    """Gemma-2's tanh softcapping of the scores and gpt-oss's learned sink logit: no warning, and the
    shift does move the logits."""
    if family == "gpt_oss":
        model, inputs, _ = coverage.reference("gpt_oss")
    else:
        config = CONFIGS["gemma2"]()
        config.attn_logit_softcapping = 1.0
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        inputs = {"input_ids": IDS}
    lens = conceptlens.attach(model)
    site = lens.site("blocks.0.attn.k")
    with torch.no_grad():
        clean = model(**inputs).logits
    edit = Add(200 * torch.randn(width(site), generator=torch.Generator().manual_seed(0)), 1.0, site=site.name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scope = lens.steer(edit)
    with torch.no_grad(), scope:
        logits = model(**inputs).logits
    assert not [w for w in caught if "cancels" in str(w.message)]
    assert float((logits - clean).abs().max()) > 1e-4  # rounding moves them ~1e-7
