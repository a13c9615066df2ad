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
        coverage.OUTCOMES[model_type] = "not buildable"
        pytest.skip(f"transformers cannot build or run a tiny {model_type}: {err}")
    coverage.OUTCOMES[model_type] = "refused" if model_type in EXCEPTIONS else "checked"
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
    ledger = coverage.LEDGERS[model_type] = coverage.Ledger()
    coverage.check_model(model, inputs, out, partial=model_type in PARTIAL, ledger=ledger)
    coverage.check_attention(model, inputs, sink_scaled=model_type in SINK_SCALED, ledger=ledger)
    coverage.check_kv_cache(model, inputs, refused=model_type in KV_CHANGED_AFTER_CACHE,
                            one_decoder_token=model_type in ONE_DECODER_TOKEN_WITH_CACHE, ledger=ledger)
    blocks = sum(conceptlens.attach(model).adapter.n_blocks.values())
    assert ledger.ran["resid_out = hidden_states"] == blocks, "a block's resid_out was not compared with HF"


# Types whose comparison ran, at least, when every type runs (DESIGN.md, "Coverage"): a change
# that makes a check return early without a word lowers a count and fails here.
AT_LEAST = {
    "embed = hidden_states[0]": 244,
    "resid_out = hidden_states": 248,
    "sublayer sum = resid_out": 194,
    "pattern (captured q, k) = eager weights": 206,
    "k/v with cache = without": 169,
    "cached forward refused": 19,
    "mlp.post = down projection's input": 187,
}


def test_every_comparison_ran_as_often_as_recorded():
    """Runs after the per-type tests (file order): counts the types each comparison reached."""
    missing = set(model_types()) - set(coverage.OUTCOMES) - TOO_SLOW_TO_BUILD
    if missing:
        pytest.skip(f"{len(missing)} types were not run in this session (-k or -m): the counts need every type")
    assert sum(1 for o in coverage.OUTCOMES.values() if o == "checked") >= AT_LEAST["resid_out = hidden_states"]
    for what, floor in AT_LEAST.items():
        n = sum(1 for led in coverage.LEDGERS.values() if led.ran[what])
        assert n >= floor, f"{what}: {n} types compared, fewer than the {floor} recorded\n" + \
            "\n".join(coverage.summary())


def test_harness_covers_the_auto_mappings():
    types = model_types()
    assert {"llama", "bert", "t5", "bart", "mamba", "jamba", "gemma3_text"} <= set(types)
    assert len(types) > 200
