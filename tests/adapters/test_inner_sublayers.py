"""Sublayer sites that no plain layout rule finds: a post-LN block whose sublayer adds exactly
zero (MRA's attention without its CUDA kernel), a sublayer that adds and norms the residual
inside itself with a bare parameter (XLNet's attention), and a reversible two-stream block
(Reformer). Each read equals the tensor taken by a manual hook on the HF module, and each edit
changes the forward exactly as the same change made by that manual hook."""

from __future__ import annotations

import torch

import conceptlens
from conceptlens.sites.hooked_views import CallOf
from conceptlens.steering import Add
from tests.adapters import coverage
from tests.conftest import Batches


def _vector(width: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(width, generator=torch.Generator().manual_seed(seed))


def _manual(module, fn, call: int = 0):
    """Forward hook on `module` applying `fn` to the first output of its `call`-th call per forward
    of the enclosing module call (counted here by hand)."""
    seen = []

    def hook(mod, args, output):
        seen.append(output[0] if isinstance(output, tuple) else output)
        if len(seen) - 1 != call:
            return None
        new = fn(seen[-1])
        if isinstance(output, tuple):
            return type(output)(new, *output[1:]) if hasattr(output, "_fields") else (new, *output[1:])
        return new

    return module.register_forward_hook(hook), seen


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def test_mra_is_post_ln_and_its_sublayer_sites_are_the_dense_outputs():
    model, inputs, _ = coverage.reference("mra")
    lens = conceptlens.attach(model)
    assert not lens.adapter.problems
    assert not lens.adapter.layout("", 0).additive  # its zero attention output must not make it look pre-norm
    layer = model.mra.encoder.layer[1]
    for site, module in (("blocks.1.attn_out", layer.attention.output.dense), ("blocks.1.mlp_out", layer.output.dense)):
        assert lens.site(site).module is module
        vector = _vector(lens.site(site).width)
        handle, seen = _manual(module, lambda x: x + vector)
        try:
            expected = _logits(model, inputs)
        finally:
            handle.remove()
        cap = Batches()
        with lens.capture([site], keep_shape=True, on_batch=cap), torch.no_grad():
            model(**inputs)
        torch.testing.assert_close(cap.acts[site], seen[0], rtol=0, atol=0)
        with torch.no_grad(), lens.steer(Add(vector, site=site)):
            assert torch.equal(_logits(model, inputs), expected)


def test_xlnet_attn_out_is_the_second_dropout_call_of_its_relative_attention():
    model, inputs, _ = coverage.reference("xlnet")
    lens = conceptlens.attach(model)
    assert not lens.adapter.problems
    attn = model.transformer.layer[1].rel_attn
    site = lens.site("blocks.1.attn_out")
    assert site.module is attn.dropout and site.find(CallOf).call == 1 and "adds and norms the residual inside itself" in site.source
    vector = _vector(site.width)
    handle, seen = _manual(attn.dropout, lambda x: x + vector, call=1)  # call 0 drops attention probabilities
    try:
        expected = _logits(model, inputs)
    finally:
        handle.remove()
    norm_in = []
    handle = attn.layer_norm.register_forward_pre_hook(lambda m, args: norm_in.append(args[0]))
    try:
        cap = Batches()
        with lens.capture(["blocks.1.attn_out", "blocks.1.resid_in"], keep_shape=True, on_batch=cap), torch.no_grad():
            logits = model(**inputs).logits
    finally:
        handle.remove()
    got = cap.acts["blocks.1.attn_out"]
    assert torch.equal(got, seen[1].transpose(0, 1))  # (T, B, d) inside the model
    assert torch.equal(got + cap.acts["blocks.1.resid_in"], norm_in[0].transpose(0, 1))  # what the norm adds to
    with torch.no_grad(), lens.steer(Add(vector, site="blocks.1.attn_out")):
        assert torch.equal(_logits(model, inputs), expected)
    with torch.no_grad(), lens.steer(Add(vector, 0.0, site="blocks.1.attn_out")):
        assert torch.equal(_logits(model, inputs), logits)


def _reformer_streams(layer):
    """Manual hooks on a ReformerLayer: its two input streams and its two output streams."""
    seen = {}

    def pre(module, args, kwargs):
        seen["x1"], seen["x2"] = kwargs["prev_attn_output"], kwargs["hidden_states"]

    def post(module, args, kwargs, output):
        seen["y2"], seen["y1"] = output.hidden_states, output.attn_output

    return [layer.register_forward_pre_hook(pre, with_kwargs=True),
            layer.register_forward_hook(post, with_kwargs=True)], seen


def test_reformer_attention_adds_to_the_other_stream_of_its_reversible_block():
    model, inputs, _ = coverage.reference("reformer")
    lens = conceptlens.attach(model)
    assert not lens.adapter.problems
    names = [f"blocks.1.{k}" for k in ("resid_in", "attn_out", "mlp_out", "resid_out")]
    layer = model.reformer.encoder.layers[1]
    assert lens.adapter.layout("", 1).other_stream == ("attn_out",)
    assert "other residual stream" in lens.site("blocks.1.attn_out").source
    handles, seen = _reformer_streams(layer)
    try:
        cap = Batches()
        with lens.capture(names, keep_shape=True, on_batch=cap), torch.no_grad():
            logits = model(**inputs).logits
    finally:
        for h in handles:
            h.remove()
    acts = {n.rpartition(".")[2]: cap.acts[n] for n in names}
    assert torch.equal(acts["resid_in"], seen["x2"]) and torch.equal(acts["resid_out"], seen["y2"])
    assert torch.equal(seen["x1"] + acts["attn_out"], seen["y1"])  # Y1 = X1 + attn(X2)
    assert torch.equal(acts["resid_in"] + acts["mlp_out"], acts["resid_out"])  # Y2 = X2 + ffn(Y1)
    vector = _vector(64)
    for site, module in (("blocks.1.attn_out", layer.attention), ("blocks.0.resid_out", model.reformer.encoder.layers[0])):
        handle, _ = _manual(module, lambda x: x + vector)  # a namedtuple output: its first field edited
        try:
            expected = _logits(model, inputs)
        finally:
            handle.remove()
        assert not torch.equal(expected, logits)
        with torch.no_grad(), lens.steer(Add(vector, site=site)):
            assert torch.equal(_logits(model, inputs), expected)
        with torch.no_grad(), lens.steer(Add(vector, 0.0, site=site)):
            assert torch.equal(_logits(model, inputs), logits)


def test_xlnet_attn_out_stays_the_content_stream_when_the_query_stream_runs():
    model, inputs, _ = coverage.reference("xlnet")
    lens = conceptlens.attach(model)
    ids = inputs["input_ids"]
    perm = torch.zeros(ids.shape[0], ids.shape[1], ids.shape[1])
    perm[:, :, -1] = 1.0  # nobody sees the last token: it is predicted by the query stream
    target = torch.zeros(ids.shape[0], 1, ids.shape[1])
    target[:, 0, -1] = 1.0
    attn = model.transformer.layer[1].rel_attn
    norm_in = []
    handle = attn.layer_norm.register_forward_pre_hook(lambda m, args: norm_in.append(args[0]))
    try:
        cap = Batches()
        with lens.capture(["blocks.1.attn_out", "blocks.1.resid_in"], keep_shape=True, on_batch=cap), torch.no_grad():
            model(input_ids=ids, perm_mask=perm, target_mapping=target)
    finally:
        handle.remove()
    assert len(norm_in) == 2  # the content stream h, then the query stream g (dropout runs four times)
    acts = cap.acts
    assert torch.equal(acts["blocks.1.attn_out"] + acts["blocks.1.resid_in"], norm_in[0].transpose(0, 1))
