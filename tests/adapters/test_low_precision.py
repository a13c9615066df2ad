"""Models in bfloat16 / float16 keep their sublayer sites: the attach check reproduces the block's
sum in the model's dtype, where a float32 sum of rounded terms is off by a rounding step."""

from __future__ import annotations

import pytest
import torch

import conceptlens
from conceptlens.sites.views import Scale
from conceptlens.steering import Add
from tests.adapters import coverage
from tests.adapters.tiny_configs import build

# sequential pre-norm, post-sublayer norms (Gemma 2/3, OLMo 2), parallel (GPT-J), post-LN (BERT), seq2seq
TYPES = ["llama", "gpt2", "gemma2", "gemma3_text", "olmo2", "gptj", "bert", "t5", "bart"]


def _modules(lens, model):
    names = {m: n for n, m in model.named_modules()}
    return {k: (names.get(s.module), s.point) for k, s in lens.sites.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model_type", TYPES)
def test_low_precision_model_keeps_every_site(model_type, dtype):
    model = build(model_type)
    full = _modules(conceptlens.attach(model), model)
    model.to(dtype)
    lens = conceptlens.attach(model)
    assert not lens.adapter.problems, lens.adapter.problems
    assert _modules(lens, model) == full  # the same modules as in float32, not another reading
    inputs = {k: v for k, v in coverage.inputs_for(model).items()}
    stack = "encoder" if model.config.is_encoder_decoder else ""
    p = f"{stack}." if stack else ""
    names = [f"{p}blocks.0.{k}" for k in ("resid_in", "attn_out", "mlp_out", "resid_out")]
    acts = coverage.capture_all(lens, model, inputs, names)
    x, a, m, y = (acts[n].to(dtype) for n in names)  # captures come as float32: exact for these values
    if lens.adapter.layout(stack, 0).additive:  # (post-LN blocks norm the sum: BERT, BART)
        assert any(torch.equal(total, y) for total in (x + a + m, a + m + x, x + (a + m)))  # the block's rounding


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_bfloat16_edit_equals_a_manual_hook(model_type):
    model = build(model_type).to(torch.bfloat16)
    lens = conceptlens.attach(model)
    inputs = coverage.inputs_for(model)
    site = lens.site("blocks.1.mlp_out")
    vector = torch.randn(site.width, generator=torch.Generator().manual_seed(0))
    with lens.steer(Add(vector, 2.0, site=site.name)), torch.no_grad():
        steered = model(**inputs).logits
    handle = site.module.register_forward_hook(lambda mod, args, out: out + (2.0 * vector).to(out.dtype))
    try:
        with torch.no_grad():
            manual = model(**inputs).logits
    finally:
        handle.remove()
    assert torch.equal(steered, manual)


@pytest.mark.real_model
def test_smollm2_in_bfloat16_keeps_every_site():
    """The real SmolLM2 cast to bfloat16: the same 362 sites on the same modules, with no problem
    (before, 58 sublayer sites were dropped as "differs from resid_out")."""
    from conceptlens import models

    model, tok = models.load("smollm2-135m")
    full = _modules(conceptlens.attach(model, tok), model)
    model.to(torch.bfloat16)
    lens = conceptlens.attach(model, tok)
    assert not lens.adapter.problems
    assert _modules(lens, model) == full


def test_bfloat16_block_constants_are_the_config_constants():
    """Granite adds residual + sublayer * residual_multiplier: in bfloat16 the fitted constant is
    the config's 0.22 (a least-squares fit on rounded terms is only near it), and the sites read
    exactly the terms the block adds."""
    import transformers as tf

    from tests.adapters.tiny_configs import tiny_config

    config = tiny_config("granite")
    config.residual_multiplier = 0.22
    torch.manual_seed(0)
    model = tf.GraniteForCausalLM._from_config(config, attn_implementation="eager").eval().to(torch.bfloat16)
    lens = conceptlens.attach(model)
    assert not lens.adapter.problems
    assert lens.site("blocks.0.attn_out").find(Scale).factor == lens.site("blocks.1.mlp_out").find(Scale).factor == 0.22
    inputs = coverage.inputs_for(model)
    names = [f"blocks.0.{k}" for k in ("resid_in", "attn_out", "mlp_out", "resid_out")]
    seen = {}
    layer = model.model.layers[0]
    handles = [layer.self_attn.register_forward_hook(lambda m, a, o: seen.update(attn=o[0])),
               layer.mlp.register_forward_hook(lambda m, a, o: seen.update(mlp=o))]
    try:
        acts = coverage.capture_all(lens, model, inputs, names)
    finally:
        for h in handles:
            h.remove()
    x, a, m, y = (acts[n].to(torch.bfloat16) for n in names)
    assert torch.equal(a, seen["attn"] * 0.22) and torch.equal(m, seen["mlp"] * 0.22)
    assert torch.equal((x + a) + m, y)
