"""Capture: padding dropped, rows aligned, token bookkeeping, stop-early forwards."""

from __future__ import annotations

import pytest
import torch

import conceptlens
from tests.conftest import Batches, tiny_inputs, tiny_model


def test_flat_rows_are_real_tokens_aligned_across_sites():
    model = tiny_model("llama")
    lens = conceptlens.attach(model)
    inputs = tiny_inputs("llama")  # row 0 has 2 left pads
    names = ["blocks.0.resid_out", "blocks.1.attn.q", "blocks.1.attn.k"]
    batches = []
    with torch.no_grad(), lens.capture(names, on_batch=lambda a, m: batches.append((a, m))):
        model(**inputs)
    full = Batches()
    with torch.no_grad(), lens.capture(names, keep_shape=True, on_batch=full):
        model(**inputs)
    assert len(batches) == 1
    acts, meta = batches[0]
    keep = inputs["attention_mask"].bool()
    n = int(keep.sum())
    assert acts["blocks.0.resid_out"].shape == (n, 32)
    assert acts["blocks.1.attn.q"].shape == (n, 4, 8) and acts["blocks.1.attn.k"].shape == (n, 2, 8)
    for name in names:
        assert torch.equal(acts[name], full.acts[name][keep])
        assert acts[name].dtype == torch.float32
    rows, cols = keep.nonzero(as_tuple=True)
    assert torch.equal(meta.row, rows)
    assert torch.equal(meta.token, inputs["input_ids"][rows, cols])
    assert torch.equal(meta.position, (keep.cumsum(-1) - 1)[rows, cols])
    assert meta.position[:5].tolist() == [0, 1, 2, 3, 4]  # row 0 starts after its padding


def test_stop_early_runs_nothing_after_the_deepest_site():
    model = tiny_model("llama")
    lens = conceptlens.attach(model)
    inputs = tiny_inputs("llama")
    calls = []
    spies = [model.model.layers[1].register_forward_pre_hook(lambda *a: calls.append("block1")),
             model.lm_head.register_forward_pre_hook(lambda *a: calls.append("head"))]
    try:
        seen = Batches()
        with lens.capture(["blocks.0.resid_out", "blocks.0.attn.k"], on_batch=seen) as cap:
            acts, meta = cap.forward(**inputs)
            assert calls == [] and len(seen) == 1 and seen.acts is acts and seen.meta is meta  # on_batch ran too
            with torch.no_grad():
                model(**inputs)
            assert calls == ["block1", "head"]
            for name in acts:
                assert torch.equal(acts[name], seen.acts[name])
            for got, full in zip(meta, seen.meta):  # row, position, token, keep: as the full forward's
                assert torch.equal(got, full)
    finally:
        for spy in spies:
            spy.remove()


def test_capture_only_forward_outside_with_is_an_error():
    lens = conceptlens.attach(tiny_model("gpt2"))
    cap = lens.capture("blocks.0.resid_out")
    with pytest.raises(RuntimeError, match="inside"):
        cap.forward(**tiny_inputs("gpt2"))


def test_positions_through_the_kv_cache_during_generate():
    model = tiny_model("llama")
    lens = conceptlens.attach(model)
    inputs = tiny_inputs("llama")
    metas = []
    with torch.no_grad(), lens.capture("blocks.1.attn.k", on_batch=lambda a, m: metas.append((a, m))):
        model.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert len(metas) == 3  # the prompt pass and two cached steps
    prompt_len = inputs["attention_mask"].sum(-1)
    for step, (acts, meta) in enumerate(metas[1:], start=1):
        assert acts["blocks.1.attn.k"].shape == (3, 2, 8)  # only the new token, not the cache
        assert torch.equal(meta.position, prompt_len + step - 1)
        assert torch.equal(meta.row, torch.arange(3))


def _sliding_only(window):
    """Mistral whose every layer slides: a static cache's masks show only the window."""
    import transformers as tf

    from tests.conftest import _LLAMA_LIKE

    torch.manual_seed(0)
    return tf.MistralForCausalLM(tf.MistralConfig(**_LLAMA_LIKE, sliding_window=window)).eval()


@pytest.mark.parametrize("make", [lambda: _sliding_only(3), lambda: _sliding_only(11), lambda: tiny_model("llama")],
                         ids=["window-3", "window-filled-while-generating", "llama"])
def test_a_static_cache_captures_the_rows_and_positions_of_a_dynamic_one(make):
    """With every layer sliding, the static cache's 4-D masks hide the tokens before the window:
    the prompt pass kept only the window's rows and every generated token sat at position 2."""
    model = make()
    lens = conceptlens.attach(model)
    ids = torch.randint(3, 99, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # two left pads
    captured = {}
    for cache in ("dynamic", "static"):
        seen = Batches()
        with torch.no_grad(), lens.capture(["blocks.1.resid_out", "blocks.0.attn.k"], on_batch=seen):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                           cache_implementation=cache)
        captured[cache] = seen
    dynamic, static = captured["dynamic"], captured["static"]
    assert len(static) == len(dynamic) == 4
    for (acts, meta), (want_acts, want) in zip(static, dynamic):
        assert torch.equal(meta.row, want.row) and torch.equal(meta.position, want.position)
        assert torch.equal(meta.keep, want.keep) and torch.equal(meta.token, want.token)
        for name, x in acts.items():
            torch.testing.assert_close(x, want_acts[name], rtol=0, atol=1e-5)
    assert torch.equal(dynamic[0][1].position[:7], torch.arange(7))  # row 0: its 7 real tokens
    assert torch.equal(dynamic[-1][1].position, torch.tensor([9, 11]))  # the third generated token


def _rows(seen):
    """Every captured row of a generate as {(batch row, position): (token, activation)}."""
    out = {}
    for acts, meta in seen:
        for i, (r, p, t) in enumerate(zip(meta.row.tolist(), meta.position.tolist(), meta.token.tolist())):
            assert (r, p) not in out, f"row {r} position {p} captured twice"
            out[r, p] = (t, acts["blocks.1.resid_out"][i])
    return out


@pytest.mark.parametrize("make", [lambda: _sliding_only(3), lambda: tiny_model("llama")], ids=["window-3", "llama"])
@pytest.mark.parametrize("chunk", [None, 2, 4], ids=["whole-prompt", "chunks-of-2", "chunks-of-4"])
def test_a_static_cache_counts_rows_that_are_all_padding_so_far(make, chunk):
    """A row that is all padding in a forward (a prompt of only padding, or a first prefill chunk
    of it) has no position to carry: the next token of that row is its position 0 (it was 1)."""
    model = make()
    lens = conceptlens.attach(model)
    ids = torch.randint(3, 99, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :] = 0  # a prompt of only padding
    mask[2, :6] = 0  # six left pads: the first chunks of this row hold no token
    captured = {}
    for cache, extra in (("dynamic", {}), ("static", {} if chunk is None else {"prefill_chunk_size": chunk})):
        seen = Batches()
        with torch.no_grad(), lens.capture("blocks.1.resid_out", on_batch=seen):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                           cache_implementation=cache, **extra)
        captured[cache] = _rows(seen)
    static, dynamic = captured["static"], captured["dynamic"]
    assert sorted(static) == sorted(dynamic)
    assert {p for r, p in dynamic if r == 0} == {0, 1}  # generated tokens only, from position 0
    assert {p for r, p in dynamic if r == 2} == set(range(5))
    for key, (token, x) in dynamic.items():
        assert static[key][0] == token
        torch.testing.assert_close(static[key][1], x, rtol=0, atol=1e-4)


def test_keep_shape_meta_and_drop_special():
    class Tok:
        all_special_ids = [5, 6]

    model = tiny_model("gpt2")
    lens = conceptlens.attach(model, Tok())
    inputs = tiny_inputs("gpt2")
    inputs["input_ids"][1, 3] = 5
    seen = Batches()
    with torch.no_grad(), lens.capture("blocks.0.resid_out", drop_special=True, on_batch=seen):
        model(**inputs)
    acts, meta = seen[-1]
    expected = inputs["attention_mask"].bool() & (inputs["input_ids"] != 5) & (inputs["input_ids"] != 6)
    assert torch.equal(meta.keep, expected)
    assert acts["blocks.0.resid_out"].shape[0] == int(expected.sum())
    with pytest.raises(ValueError, match="tokenizer"):
        conceptlens.attach(model).capture("blocks.0.resid_out", drop_special=True)


def test_encoder_decoder_streams_and_generate():
    model = tiny_model("t5")
    lens = conceptlens.attach(model)
    inputs = tiny_inputs("t5")
    with pytest.raises(ValueError, match="different token streams"):
        lens.capture(["encoder.blocks.0.resid_out", "decoder.blocks.0.resid_out"])
    enc, dec = [], []
    prompt = {k: v for k, v in inputs.items() if k != "decoder_input_ids"}
    with torch.no_grad(), lens.capture("encoder.blocks.1.resid_out", on_batch=lambda a, m: enc.append(m)), \
            lens.capture(["decoder.blocks.0.resid_out", "decoder.blocks.1.cross_attn.q"],
                         on_batch=lambda a, m: dec.append(a)):
        model.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert len(enc) == 1 and int(enc[0].keep.sum()) == int(inputs["attention_mask"].sum())
    assert len(dec) == 3 and all(a["decoder.blocks.0.resid_out"].shape == (3, 32) for a in dec)
    seen = Batches()
    with torch.no_grad(), lens.capture("decoder.blocks.0.cross_attn.k", on_batch=seen):
        model(**inputs)
    assert seen.acts["decoder.blocks.0.cross_attn.k"].shape == (int(inputs["attention_mask"].sum()), 4, 8)


def test_inputs_embeds_give_unknown_token_ids():
    model = tiny_model("llama")
    lens = conceptlens.attach(model)
    embeds = model.model.embed_tokens(torch.tensor([[4, 5, 6]]))
    seen = Batches()
    with torch.no_grad(), lens.capture("blocks.0.resid_out", on_batch=seen):
        model(inputs_embeds=embeds)
    assert seen.meta.token.tolist() == [-1, -1, -1]
    assert seen.meta.position.tolist() == [0, 1, 2]


def test_positions_a_model_pads_inside_are_no_tokens():
    """Reformer pads inputs longer than its chunk to a multiple of it and keeps the padding in its
    blocks: a capture keeps one row per real token, with its id, and none for the padding."""
    from tests.adapters.tiny_configs import build

    model = build("reformer")  # chunk length 8: 10 tokens run as 16 positions
    lens = conceptlens.attach(model)
    ids = torch.randint(4, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    seen = Batches()
    with lens.capture(["blocks.0.resid_out"], on_batch=seen), torch.no_grad():
        model(input_ids=ids)
    rows, meta = seen[-1]
    assert rows["blocks.0.resid_out"].shape[0] == ids.numel()
    assert torch.equal(meta.token, ids.reshape(-1)) and torch.equal(meta.position, torch.arange(10).repeat(2))
    with lens.capture(["blocks.0.resid_out"], keep_shape=True, on_batch=seen), torch.no_grad():
        model(input_ids=ids)
    assert seen.acts["blocks.0.resid_out"].shape[1] == 16 and int(seen.meta.keep.sum()) == ids.numel()


def test_sites_argument_errors_and_a_site_of_another_lens_on_the_same_model():
    model = tiny_model("llama")
    lens, other = conceptlens.attach(model), conceptlens.attach(model)
    for bad in (3, None, b"blocks.0.resid_out"):
        with pytest.raises(TypeError, match=f"sites must be a site name, a Site or a list of them; got "
                                            f"{type(bad).__name__}"):
            lens.capture(bad)
    # a Site from a lens of the same model is the same site; of another model, refused
    with lens.capture([other.site("blocks.0.resid_out")], keep_shape=True) as cap:
        acts, _ = cap.forward(**tiny_inputs("llama"))
    assert acts["blocks.0.resid_out"].shape[:2] == (3, 7)
    with pytest.raises(ValueError, match="belongs to another model"):
        lens.capture([conceptlens.attach(tiny_model("llama", seed=1)).site("blocks.0.resid_out")])


@pytest.mark.parametrize("site", ["blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.resid_out", "blocks.0.attn.z"])
def test_a_hook_result_is_cast_to_the_sites_dtype(site):
    """A float32 result of `lens.hook` on a bf16 model replaces the site's value in bf16 at every site
    (it failed inside the attention kernel at q, resid_out and z)."""
    model = tiny_model("llama", attn="sdpa").to(torch.bfloat16)
    lens = conceptlens.attach(model)
    inputs = tiny_inputs("llama")
    with torch.no_grad():
        clean = model(**inputs).logits
    handle = lens.hook(site, lambda x: x.float() * 2)  # a real edit, returned in float32
    try:
        with torch.no_grad():
            doubled = model(**inputs).logits
    finally:
        handle.remove()
    seen = []
    handle = lens.hook(site, lambda x: seen.append(x.dtype) or (x * 2))
    try:
        with torch.no_grad():
            reference = model(**inputs).logits
    finally:
        handle.remove()
    assert seen and set(seen) == {torch.bfloat16}
    assert torch.equal(doubled, reference) and not torch.equal(doubled, clean)
