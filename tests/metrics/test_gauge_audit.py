import contextlib
import sys

import pytest
import torch
from transformers import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from conceptlens.metrics.capture_qk import qk_capture
from conceptlens.metrics.gauge_audit import AUDIT_METRICS, apply_gauge, gauge_audit, gauged, random_gauge

INVARIANT = ("key_distance", "score_cosine", "qk_spectrum")


@contextlib.contextmanager
def _recording_eager_attention(model, records):
    """Route the model's attention through its own eager function, recording (query, key)."""
    modeling = sys.modules[type(model).__module__]
    original, implementation = modeling.eager_attention_forward, model.config._attn_implementation

    def recorder(module, query, key, *args, **kwargs):  # query (B, H, T, d), key (B, H_kv, T, d)
        records[module.layer_idx] = (query.transpose(1, 2), key.transpose(1, 2))
        return original(module, query, key, *args, **kwargs)

    modeling.eager_attention_forward = recorder
    model.config._attn_implementation = "eager"
    try:
        yield
    finally:
        modeling.eager_attention_forward = original
        model.config._attn_implementation = implementation


def eager_qk(model, inputs):
    """Reference q/k straight from HF's eager attention function."""
    records = {}
    with torch.no_grad(), _recording_eager_attention(model, records):
        model(**inputs)
    return records


def _llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
    return LlamaForCausalLM(config)


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=97, bos_token_id=0, eos_token_id=0, n_embd=64, n_layer=2, n_head=4, n_positions=64))


def _bert():
    torch.manual_seed(0)
    return BertModel(BertConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=96, max_position_embeddings=64))


def _inputs(batch=3, length=24):
    ids = torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0  # some padding: the audit must drop it
    return {"input_ids": ids, "attention_mask": mask}


def _perturb_biases(model):
    """Random models start with zero biases; make them nonzero so the bias transform is tested."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and any(s in name for s in ("q_proj", "k_proj", "c_attn", "query", "key")):
                p.normal_(0, 0.5)


@pytest.mark.parametrize("build,group", [(_llama, "rotary"), (_gpt2, "general"), (_bert, "general")])
def test_audit_keeps_outputs_and_separates_invariant_metrics(build, group):
    model = build()
    _perturb_biases(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    report = gauge_audit(model, _inputs(), seed=3)  # default: q/k read at the attn.q/.k sites
    assert report.group == group
    assert report.logits_max_abs_diff < 1e-3 * max(1.0, report.logits_max_abs)
    assert report.logits_max_abs_diff < 1e-3
    for name in INVARIANT:
        assert report.relative_change[name] < 1e-4, (name, report.relative_change)
    for name in ("key_cosine", "key_norm"):
        assert report.relative_change[name] > 1e-2, (name, report.relative_change)
    assert set(report.moved()) >= {"key_cosine", "key_norm"} and not set(report.moved()) & set(INVARIANT)
    assert len(report.per_layer["key_norm"]) == 2
    # the model is exactly as it was, modes included
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(m.training for m in model.modules())


def test_general_gauge_on_a_rotary_model_is_caught():
    metrics = {"key_distance": AUDIT_METRICS["key_distance"]}
    report = gauge_audit(_llama(), _inputs(), metrics=metrics, group="general")
    assert report.group == "general"
    assert report.logits_max_abs_diff > 1e-3  # the true symmetries give ~2e-7 here
    assert report.relative_change["key_distance"] > 1e-2


def test_rotary_gauge_is_valid_on_models_without_rotary_too():
    metrics = {name: AUDIT_METRICS[name] for name in ("key_distance", "key_norm")}
    report = gauge_audit(_gpt2(), _inputs(), metrics=metrics, group="rotary", seed=5)
    assert report.logits_max_abs_diff < 1e-4
    assert report.relative_change["key_distance"] < 1e-4 < 1e-2 < report.relative_change["key_norm"]


def test_gqa_shares_one_matrix_per_key_head_and_gauged_restores():
    model = _llama().eval()
    t = random_gauge(model, seed=1)
    assert set(t.matrices) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert t.matrices["model.layers.0.self_attn"].shape == (2, 16, 16)
    inputs = _inputs()
    capture = qk_capture(layers=[1])
    q, k = capture(model, inputs)[1]
    with gauged(model, t):
        q2, k2 = capture(model, inputs)[1]
    A = t.matrices["model.layers.1.self_attn"].float()
    # query heads 0, 1 read key head 0; heads 2, 3 read key head 1 (HF's h // g)
    expected_q = torch.einsum("hab,nhb->nha", A.repeat_interleave(2, 0), q)
    torch.testing.assert_close(q2, expected_q, rtol=1e-4, atol=1e-4)
    expected_k = torch.einsum("hab,nhb->nha", torch.linalg.inv(A).transpose(-1, -2), k)
    torch.testing.assert_close(k2, expected_k, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("build", [_llama, _gpt2, _bert])
def test_default_capture_reads_what_the_eager_attention_function_receives(build):
    model, inputs = build().eval(), _inputs()
    mask = inputs["attention_mask"].bool()
    ours, reference = qk_capture()(model, inputs), eager_qk(model, inputs)
    assert sorted(ours) == sorted(reference) == [0, 1]
    for layer, (q, k) in reference.items():
        torch.testing.assert_close(ours[layer][0], q[mask], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours[layer][1], k[mask], rtol=1e-5, atol=1e-6)
    assert sorted(qk_capture(layers=[-1])(model, inputs)) == [1]


def test_qk_capture_rejects_layers_the_model_lacks():
    with pytest.raises(ValueError, match=r"layers \[2\] are not blocks of this model \(0..1"):
        qk_capture(layers=[2])(_gpt2(), _inputs())
    with pytest.raises(ValueError, match="stack must be one of"):
        qk_capture(stack="encoder")(_gpt2(), _inputs())


def test_inverse_undoes_apply_up_to_rounding():
    model = _gpt2()
    _perturb_biases(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    t = random_gauge(model, seed=2)
    apply_gauge(model, t)
    assert not torch.allclose(model.transformer.h[0].attn.c_attn.weight, before["transformer.h.0.attn.c_attn.weight"])
    apply_gauge(model, t.inverse())
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=1e-5, atol=1e-6)


def test_unsupported_models_and_bad_arguments_say_why():
    qwen3 = Qwen3ForCausalLM(Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    with pytest.raises(NotImplementedError, match="qwen3.*q_norm"):
        random_gauge(qwen3)
    with pytest.raises(NotImplementedError, match="no supported attention"):
        random_gauge(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="group must be one of"):
        random_gauge(_gpt2(), group="orthogonal")
    with pytest.raises(ValueError, match="transform is for attention modules"):
        apply_gauge(_gpt2(), random_gauge(_llama()))
