"""q/k captured from the attention function reproduce the model's own attention weights."""

from __future__ import annotations

import math

import pytest
import torch

import conceptlens
from tests.conftest import Batches, tiny_inputs, tiny_model


def _softmax_masked(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    # scores: (B, H, T, S); allowed: broadcastable bool
    return scores.masked_fill(~allowed, torch.finfo(scores.dtype).min).softmax(-1)


def _capture(model, lens, names, inputs):
    seen = Batches()
    with torch.no_grad(), lens.capture(names, keep_shape=True, on_batch=seen):
        out = model(**inputs, output_attentions=True)
    return seen.acts, out


def _pad_and_causal(inputs, length, causal):
    mask = inputs["attention_mask"].bool()[:, None, None, :]  # (B, 1, 1, S)
    if causal:
        mask = mask & torch.ones(length, length, dtype=torch.bool).tril()
    return mask


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_decoder_attention_weights_from_captured_qk(family):
    model = tiny_model(family, attn="eager")
    lens = conceptlens.attach(model)
    inputs = tiny_inputs(family)
    acts, out = _capture(model, lens, ["blocks.1.attn.q", "blocks.1.attn.k"], inputs)
    q = acts["blocks.1.attn.q"].transpose(1, 2)  # (B, H, T, d)
    k = acts["blocks.1.attn.k"].transpose(1, 2)  # (B, H_kv, T, d)
    heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[-1]
    assert (heads, kv_heads) == ((4, 2) if family == "llama" else (4, 4))
    k = k.repeat_interleave(heads // kv_heads, dim=1)  # GQA: query head h reads key head h // g
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    weights = _softmax_masked(scores, _pad_and_causal(inputs, q.shape[2], causal=True))
    keep = inputs["attention_mask"].bool()  # padded query rows are not meaningful
    torch.testing.assert_close(weights[keep.nonzero(as_tuple=True)[0], :, keep.nonzero(as_tuple=True)[1]],
                               out.attentions[1][keep.nonzero(as_tuple=True)[0], :, keep.nonzero(as_tuple=True)[1]],
                               atol=1e-5, rtol=0)


def test_bert_attention_weights_from_captured_qk():
    model = tiny_model("bert", attn="eager")
    lens = conceptlens.attach(model)
    inputs = tiny_inputs("bert")
    acts, out = _capture(model, lens, ["blocks.0.attn.q", "blocks.0.attn.k"], inputs)
    q, k = acts["blocks.0.attn.q"].transpose(1, 2), acts["blocks.0.attn.k"].transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    weights = _softmax_masked(scores, _pad_and_causal(inputs, q.shape[2], causal=False))
    torch.testing.assert_close(weights, out.attentions[0], atol=1e-5, rtol=0)


def test_t5_attention_weights_from_captured_qk_with_relative_bias():
    model = tiny_model("t5", attn="eager")
    lens = conceptlens.attach(model)
    inputs = tiny_inputs("t5")
    names = ["encoder.blocks.1.attn.q", "encoder.blocks.1.attn.k"]
    acts, out = _capture(model, lens, names, inputs)
    q, k = acts[names[0]].transpose(1, 2), acts[names[1]].transpose(1, 2)
    length = q.shape[2]
    # T5: no 1/sqrt(d) scaling; block 0's relative position bias is shared by every block.
    bias = model.encoder.block[0].layer[0].SelfAttention.compute_bias(length, length)  # (1, H, T, T)
    scores = q @ k.transpose(-1, -2) + bias
    weights = _softmax_masked(scores, _pad_and_causal(inputs, length, causal=False))
    torch.testing.assert_close(weights, out.encoder_attentions[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "t5", "bart"])
def test_qk_same_under_eager_and_sdpa(family):
    inputs = tiny_inputs(family)
    p = "decoder." if family in ("t5", "bart") else ""
    names = [f"{p}blocks.0.attn.q", f"{p}blocks.1.attn.k", f"{p}blocks.1.attn.v"]
    captured = []
    for attn in ("eager", "sdpa"):  # flat capture: padded rows legitimately differ between kernels
        model = tiny_model(family, attn=attn)
        seen = Batches()
        with torch.no_grad(), conceptlens.attach(model).capture(names, on_batch=seen):
            model(**inputs)
        captured.append(seen.acts)
    for name in names:
        torch.testing.assert_close(captured[0][name], captured[1][name], atol=1e-6, rtol=0)
