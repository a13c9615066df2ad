"""Coverage over transformers itself: every LM model type, built tiny and checked against HF.

For each model type of transformers' causal-LM, masked-LM and seq2seq auto mappings, a tiny
random config (tiny_configs.py) is built. Types that transformers itself cannot build or run
from it are skipped with its error (counted in DESIGN.md). For the rest: attach works, every
resid_out equals HF's hidden state, resid_in + attn_out (+ cross_attn_out, mixer_out) + mlp_out
== resid_out in pre-norm blocks, and q/k from the attention function reproduce the eager
attention weights. Known exceptions must fail with a clear error instead.
"""

from __future__ import annotations

import pytest
import torch

import conceptlens
from tests.adapters import coverage
from tests.adapters.tiny_configs import model_types

# Exceptions: attach refuses with a clear error (each is explained in DESIGN.md).
EXCEPTIONS = {
    "blt": "hidden states",
    "funnel": "pools the sequence",
}
# Pre-norm blocks whose sublayer outputs do not add up to the block output (the residual itself
# scaled, extra branches, ...): attach drops their attn_out / mlp_out sites and names the reason
# instead of giving wrong activations; every other site is checked.
PARTIAL: set[str] = set()
# Attention sinks applied after the softmax: HF's eager weights leave them out, the pattern site includes them.
SINK_SCALED = {"granite_swa", "granitemoe_swa"}
# Not working yet (reported as such in DESIGN.md); strict, so a fix shows up.
KNOWN_FAILING: dict[str, str] = {}
# Attention modules that change k/v between the cache and the attention function (DiffLlama splits
# v in two halves, JetMoE repeats k/v per expert, multi-head latent attention caches the latent and
# expands it): k/v hooks refuse a cached forward.
KV_CHANGED_AFTER_CACHE = {"diffllama", "jetmoe", "axk1", "axk2", "bailing_hybrid", "deepseek_v2", "deepseek_v3",
                          "deepseek_v32", "deepseek_v4", "glm4_moe_lite", "glm_moe_dsa", "hy_v4", "kimi_linear",
                          "sarvam_mla", "youtu", "longcat_flash", "minicpm3", "dots3_note", "dots3_note_text"}
# With a cache, transformers runs another function on several decoder tokens (FSMT builds no causal
# mask when use_cache is set): the cache check then compares forwards of one decoder token.
ONE_DECODER_TOKEN_WITH_CACHE = {"fsmt"}
# transformers needs minutes to build these from the generic tiny config (none since sub-configs are shrunk).
TOO_SLOW_TO_BUILD: set[str] = set()
SLOW = {"afmoe", "encoder-decoder", "luke", "perceiver", "vibevoice_asr"}


def _param(t: str):
    marks = [pytest.mark.slow] if t in SLOW else []
    if t in KNOWN_FAILING:
        marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_FAILING[t]))
    return pytest.param(t, marks=marks)


TYPES = [_param(t) for t in model_types()]


@pytest.mark.parametrize("model_type", TYPES)
def test_model_type(model_type):
    if model_type in TOO_SLOW_TO_BUILD:
        pytest.skip(f"transformers takes minutes to build a tiny {model_type} from the generic config")
    try:
        model, inputs, out = coverage.reference(model_type)
    except coverage.NotBuildable as err:
        pytest.skip(f"transformers cannot build or run a tiny {model_type}: {err}")
    if model_type in EXCEPTIONS:
        with pytest.raises(ValueError, match=EXCEPTIONS[model_type]):  # a clear error, not wrong sites
            conceptlens.attach(model)
        return
    if model_type in PARTIAL:
        lens = conceptlens.attach(model)
        assert lens.adapter.problems
        for name, reason in lens.adapter.problems.items():
            assert name not in lens.sites
            with pytest.raises(KeyError, match="differs from resid_out|did not run|has shape|merged attention|"
                                               "inside itself"):
                lens.site(name)
    coverage.check_model(model, inputs, out, partial=model_type in PARTIAL)
    coverage.check_attention(model, inputs, sink_scaled=model_type in SINK_SCALED)
    coverage.check_kv_cache(model, inputs, refused=model_type in KV_CHANGED_AFTER_CACHE,
                            one_decoder_token=model_type in ONE_DECODER_TOKEN_WITH_CACHE)


def test_harness_covers_the_auto_mappings():
    types = model_types()
    assert {"llama", "bert", "t5", "bart", "mamba", "jamba", "gemma3_text"} <= set(types)
    assert len(types) > 200
