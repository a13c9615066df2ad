"""q/k/v of attention written by hand: fused projections (Bloom, Falcon, MPT, GPT-1,
GPT-NeoX-Japanese) and projections one module below the attention (GPT-Neo, MPNet, Perceiver,
BigBird-Pegasus). Checked against HF's eager attention weights A: each head's output is A @ v,
and softmax of the scores the model's own code forms from q and k (its scaling, ALiBi or rotary
from HF's own functions, the causal mask) is A."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.falcon import modeling_falcon
from transformers.models.gpt_neox_japanese import modeling_gpt_neox_japanese as neox_ja

import transformers as tf

import conceptlens
from conceptlens.sites.views import FusedPart
from conceptlens.steering import Add
from tests.adapters import coverage
from tests.adapters.tiny_configs import tiny_config
from tests.conftest import Batches

FUSED = ["bloom", "falcon", "falcon-grouped", "falcon-per-head", "mpt", "openai-gpt", "gpt_neox_japanese"]
# Falcon's three layouts: multi-query (the tiny default), groups of k/v heads (Falcon-40B), one k/v per head
FALCON = {"falcon-grouped": {"new_decoder_architecture": True, "num_kv_heads": 2},
          "falcon-per-head": {"multi_query": False, "num_kv_heads": 4}}
NESTED = ["gpt_neo", "mpnet", "perceiver", "bigbird_pegasus"]
OUT_PROJ = {"bloom": "self_attention.dense", "falcon": "self_attention.dense", "falcon-grouped": "self_attention.dense",
            "falcon-per-head": "self_attention.dense", "mpt": "attn.out_proj",
            "openai-gpt": "attn.c_proj", "gpt_neox_japanese": "attention.dense", "gpt_neo": "attn.attention.out_proj",
            "mpnet": "attention.attn.o", "perceiver": "attention.output.dense", "bigbird_pegasus": "self_attn.output"}


def _rotary(model, module, q, k):
    """q, k (B, T, H, d) after the model's own rotary embedding (HF's functions)."""
    base = model.base_model
    positions = torch.arange(q.shape[1])[None]
    cos, sin = base.rotary_emb(q, position_ids=positions)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    if module is neox_ja:  # partial rotary on the first rotary_ndims
        n = base.layers[0].attention.rotary_ndims
        qr, kr = module.apply_rotary_pos_emb(q[..., :n], k[..., :n], cos, sin)
        return torch.cat([qr, q[..., n:]], -1), torch.cat([kr, k[..., n:]], -1)
    return module.apply_rotary_pos_emb(q, k, cos, sin)


def _scores(model_type, model, q, k):
    """(B, H, T, S) scores before softmax, as each model's own attention code forms them."""
    h, t, d = q.shape[2], q.shape[1], q.shape[3]
    k = k.repeat_interleave(h // k.shape[2], 2)
    if model_type.startswith("falcon") or model_type == "gpt_neox_japanese":
        q, k = _rotary(model, neox_ja if model_type == "gpt_neox_japanese" else modeling_falcon, q, k)
    else:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    s = q @ k.transpose(-1, -2)
    if model_type != "gpt_neo":  # GPT-Neo does not scale its scores
        s = s / math.sqrt(d)
    if model_type == "bloom":
        alibi = model.transformer.build_alibi_tensor(torch.ones(q.shape[0], t), h, s.dtype)
        s = s + alibi.view(q.shape[0], h, 1, t)
    if model_type == "mpt":
        s = s + model.transformer.build_mpt_alibi_tensor(h, t)[None]
    if model_type in FUSED + ["gpt_neo"]:  # decoders: causal
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return s


def _model(model_type):
    if model_type not in FALCON:
        return coverage.reference(model_type)[:2]
    config = tiny_config("falcon")
    for key, value in FALCON[model_type].items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = tf.FalconForCausalLM._from_config(config, attn_implementation="eager").eval()
    return model, {**coverage.inputs_for(model), "use_cache": False}


def _run(model_type):
    model, inputs = _model(model_type)
    lens = conceptlens.attach(model)
    stack = "encoder" if model.config.is_encoder_decoder else ""
    p = f"{stack}." if stack else ""
    names = [f"{p}blocks.0.attn.{w}" for w in "qkv"]
    z = []
    block = lens.adapter.blocks[stack][0]
    handle = block.get_submodule(OUT_PROJ[model_type]).register_forward_pre_hook(lambda m, a: z.append(a[0]))
    try:
        cap = Batches()
        with lens.capture(names, keep_shape=True, on_batch=cap), torch.no_grad():
            out = model(**inputs, output_attentions=True)
    finally:
        handle.remove()
    attentions = out.encoder_attentions if stack else out.attentions
    q, k, v = (cap.acts[n] for n in names)
    return model, lens, inputs, names, q, k, v, z[0], attentions[0]


@pytest.mark.parametrize("model_type", FUSED + NESTED)
def test_qkv_reproduce_the_eager_attention(model_type):
    model, lens, _, names, q, k, v, z, a = _run(model_type)
    assert a.shape[-1] == a.shape[-2] == v.shape[1]
    heads = a.shape[1]
    z_ref = torch.einsum("bhij,bjhd->bihd", a, v.repeat_interleave(heads // v.shape[2], 2)).flatten(2)
    assert torch.allclose(z_ref, z, atol=1e-6), "head outputs != A @ v"
    if model_type != "mpnet":  # MPNet adds a learned relative-position bias
        assert torch.allclose(torch.softmax(_scores(model_type, model, q, k), -1), a, atol=1e-5), \
            "softmax(scores from q, k) != eager attention weights"
    if model_type in FUSED:
        assert "fused" in lens.site(names[0]).source


@pytest.mark.parametrize("model_type", FUSED)
@pytest.mark.parametrize("which", "qkv")
def test_edit_one_part_of_a_fused_projection(model_type, which):
    """An edit at q (k, v) changes exactly that part of the fused output; a null edit is bit-identical."""
    model, lens, inputs, names, *_ = _run(model_type)
    site = lens.site(f"blocks.0.attn.{which}")
    seen = []
    handle = site.module.register_forward_hook(lambda m, a, o: seen.append(o.detach().clone()))
    width = site.shape[-1] * site.shape[-2]
    try:
        for scale in (0.0, 1.5):
            with lens.steer(Add(torch.ones(width), scale, site=site.name)), torch.no_grad():
                model(**inputs)
        with torch.no_grad():
            plain = model(**inputs).logits
            model(**inputs)
    finally:
        handle.remove()
    null, edited, clean = seen[0], seen[1], seen[3]
    part = site.find(FusedPart).part
    assert torch.equal(null, clean)
    changed = (edited != clean)
    assert torch.equal(part.take(changed), torch.ones_like(part.take(changed)))
    assert int(changed.sum()) == part.take(changed).numel()  # nothing outside the part moved
    assert torch.allclose(part.take(edited), part.take(clean) + 1.5, atol=1e-6)
    # positions 1 on: a shift of every key would cancel in the softmax; of all but the first, it does not
    direction = torch.randn(width, generator=torch.Generator().manual_seed(0))
    with lens.steer(Add(direction, 20.0, site=site.name), positions=slice(1, None)), torch.no_grad():
        steered = model(**inputs).logits

    def by_hand(module, args, output):
        cut = part.take(output).clone()
        cut[:, 1:] += 20.0 * direction
        return part.put(output, cut)

    handle = site.module.register_forward_hook(by_hand)
    try:
        with torch.no_grad():
            manual = model(**inputs).logits
    finally:
        handle.remove()
    torch.testing.assert_close(steered, manual)
    assert float((steered - plain).abs().max()) > 1e-4  # the edit moves the logits, far above rounding (~1e-7)


def test_cpmant_qkv_are_its_projections_on_the_tokens_after_its_prompt():
    """CPM-Ant projects q/k/v with project_q/k/v on [prompt; tokens]: the sites are the tokens' rows,
    split into heads as its attention does (view(B, L, heads, dim_head)); an edit leaves the prompt."""
    model, inputs, _ = coverage.reference("cpmant")
    lens = conceptlens.attach(model)
    attn = lens.adapter.blocks[""][0].self_att.self_attention
    heads, dim = attn.num_heads, attn.dim_head
    assert lens.site("blocks.0.attn.v").shape == ("B", "T", heads, dim)
    seen = []
    handle = attn.project_v.register_forward_hook(lambda m, a, o: seen.append(o.detach().clone()))
    try:
        cap = Batches()
        with lens.capture(["blocks.0.attn.v"], keep_shape=True, on_batch=cap), torch.no_grad():
            model(**inputs)
        with lens.steer(Add(torch.ones(heads * dim), 1.0, site="blocks.0.attn.v")), torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
    length = inputs["input_ids"].shape[1]
    full = seen[0].view(*seen[0].shape[:2], heads, dim)
    assert torch.equal(cap.acts["blocks.0.attn.v"], full[:, -length:])
    changed = seen[1] != seen[0]
    assert not changed[:, :-length].any() and changed[:, -length:].all()
