"""Steering: exact reversibility, projections, positions through the KV cache, hygiene."""

from __future__ import annotations

import warnings

import pytest
import torch

import conceptlens
from conceptlens import ConceptSet
from conceptlens.hooks import attention
from conceptlens.concepts import TopKSAE, VQCodebook
from conceptlens.steering import Add, Clamp, CodeAblate, ProjectOut
from conceptlens.steering.edits import Edit
from tests.conftest import Batches, hook_snapshot, tiny_inputs, tiny_model

SITE = "blocks.0.resid_out"


@pytest.fixture
def llama():
    model = tiny_model("llama")
    return model, conceptlens.attach(model)


def _pre_post(lens, model, inputs, edits, positions="all", **gen):
    """Capture the edited site before and after the edit during one call."""
    pre, post = [], []

    def read_pre(module, args, output):  # a raw hook put in front of the edit: the unedited value
        pre.append((output[0] if isinstance(output, tuple) else output).detach().float().clone())

    with torch.no_grad(), lens.steer(*edits, positions=positions), \
            lens.capture(SITE, keep_shape=True, on_batch=lambda a, m: post.append(a[SITE])):
        handle = lens.site(SITE).module.register_forward_hook(read_pre, prepend=True)
        try:
            out = model.generate(**inputs, **gen) if gen else model(**inputs)
        finally:
            handle.remove()
    return pre, post, out


def test_add_then_subtract_is_bit_identical(llama):
    model, lens = llama
    inputs = tiny_inputs("llama")
    c = ConceptSet(torch.randn(3, 32), site=SITE)
    with torch.no_grad():
        bare = model(**inputs).logits
        with lens.steer(Add(c[0], 7.3), Add(c[0], -7.3)):
            assert torch.equal(model(**inputs).logits, bare)
        with lens.steer(Add(c[[1, 2]], 3.1)), lens.steer(Add(c[[1, 2]], -3.1)):  # nested scopes
            assert torch.equal(model(**inputs).logits, bare)
        with lens.steer(Add(c[0], 7.3)):
            assert not torch.equal(model(**inputs).logits, bare)
    pre, post, _ = _pre_post(lens, model, inputs, [Add(c[1], 2.0)])
    torch.testing.assert_close(post[0] - pre[0], (2.0 * c.directions[1]).expand_as(pre[0]))


def test_project_out_leaves_no_component(llama):
    model, lens = llama
    inputs = tiny_inputs("llama")
    directions = torch.randn(4, 32)
    directions[1] = directions[0]  # repeated and dependent directions, not only last
    directions[2] = directions[0] + 2 * directions[3]
    _, post, _ = _pre_post(lens, model, inputs, [ProjectOut(directions, site=SITE)])
    unit = directions / directions.norm(dim=1, keepdim=True)
    assert (post[0] @ unit.T).abs().max() < 1e-5 * post[0].norm(dim=-1).max()
    seen = Batches()
    with torch.no_grad(), lens.ablate(ConceptSet(directions, site=SITE)), \
            lens.capture(SITE, keep_shape=True, on_batch=seen):
        model(**inputs)
    torch.testing.assert_close(seen.acts[SITE], post[0], rtol=0, atol=0)


def _generate(model, lens, inputs, edit, positions, use_cache):
    with torch.no_grad(), lens.steer(edit, positions=positions):
        return model.generate(**inputs, max_new_tokens=6, do_sample=False, use_cache=use_cache, pad_token_id=0)


@pytest.mark.parametrize("positions", ["all", "prompt", "generated", slice(3, 8)])
@pytest.mark.parametrize("batch", [1, 3])
def test_same_tokens_with_and_without_kv_cache(llama, positions, batch):
    model, lens = llama
    inputs = tiny_inputs("llama", batch=batch)  # batch 3: row 0 is left-padded
    if batch == 1:
        inputs = {k: v[1:2] for k, v in tiny_inputs("llama", batch=2).items()}
    edit = Add(torch.randn(32, generator=torch.Generator().manual_seed(1)), 40.0, site="blocks.1.resid_out")
    cached = _generate(model, lens, inputs, edit, positions, use_cache=True)
    uncached = _generate(model, lens, inputs, edit, positions, use_cache=False)
    assert torch.equal(cached, uncached)
    with torch.no_grad():
        bare = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert not torch.equal(cached, bare)  # the edit does change generation


@pytest.mark.parametrize("positions", ["prompt", "generated"])
def test_prompt_and_generated_edit_only_their_tokens(llama, positions):
    model, lens = llama
    inputs = tiny_inputs("llama")
    vector = torch.randn(32)
    pre, post, _ = _pre_post(lens, model, inputs, [Add(vector, 5.0, site=SITE)], positions=positions,
                             max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert len(pre) == 4  # prompt pass + 3 cached steps
    changed = [(b - a).abs().amax(-1) > 0 for a, b in zip(pre, post)]  # (B, T) per forward
    if positions == "prompt":
        assert changed[0][inputs["attention_mask"].bool()].all()
        assert not any(c.any() for c in changed[1:])
    else:
        assert not changed[0].any()
        assert all(c.all() for c in changed[1:])


def test_no_hook_remains_after_exceptions(llama):
    model, lens = llama
    inputs = tiny_inputs("llama")
    snap = hook_snapshot(model)
    with pytest.raises(ZeroDivisionError), lens.steer(Add(torch.randn(32), 1.0, site=SITE)):
        assert hook_snapshot(model) != snap
        1 / 0
    assert hook_snapshot(model) == snap
    with pytest.raises(KeyError), lens.steer(Add(torch.randn(32), 1.0, site="blocks.9.resid_out")):
        pass
    with pytest.raises(ValueError, match="positions"):
        lens.steer(Add(torch.randn(32), 1.0, site=SITE), positions="middle")
    with pytest.raises(ValueError, match="has width 16"):  # q/k/v sites take concatenated heads: 2 * 8
        lens.steer(Add(torch.randn(8), 1.0, site="blocks.0.attn.k"))

    class Broken(Edit):
        site = "blocks.0.attn.k"

        def apply(self, x, mask):
            raise RuntimeError("boom")

    with lens.steer(Broken()), torch.no_grad():
        with pytest.raises(RuntimeError, match="boom"):
            model(**inputs)
    assert hook_snapshot(model) == snap and attention.active_hook_count(lens.hooks) == 0


def test_edits_compose_across_sites(llama):
    model, lens = llama
    inputs = tiny_inputs("llama")
    a = Add(torch.randn(32), 3.0, site="blocks.0.resid_out")
    b = ProjectOut(torch.randn(2, 32), site="blocks.1.attn_out")
    with torch.no_grad():
        with lens.steer(a):
            with lens.steer(b):
                both = model(**inputs).logits
        with lens.steer(a, b):
            together = model(**inputs).logits
    assert torch.equal(both, together)


def test_raw_tensor_without_site_is_an_error():
    with pytest.raises(ValueError, match="site="):
        Add(torch.randn(32), 1.0)


def test_steer_scope_entered_again_starts_a_new_prompt(llama):
    model, lens = llama
    scope = lens.steer(Add(torch.randn(32), 9.0, site=SITE), positions="generated")
    short = tiny_inputs("llama", length=4)
    longer = tiny_inputs("llama", length=9)
    with torch.no_grad():
        with scope:
            model(**short)
        bare = model(**longer).logits
        with scope:  # the first forward is this scope's prompt again: left unedited
            assert torch.equal(model(**longer).logits, bare)


def _fitted(extractor, width=32, rows=2048):
    g = torch.Generator().manual_seed(0)
    for x in (3 * torch.randn(rows, width, generator=g)).split(512):
        extractor.update(x)
    extractor.flush()
    return extractor


def test_clamp_keeps_the_reconstruction_error(llama):
    model, lens = llama
    inputs = tiny_inputs("llama")
    sae = _fitted(TopKSAE(width=64, k=4, batch_size=256, warmup_tokens=256))
    seen = Batches()
    with torch.no_grad(), lens.capture(SITE, keep_shape=True, on_batch=seen):
        bare = model(**inputs).logits
    z = sae.encode(seen.acts[SITE].reshape(-1, 32))
    silent = int((z.abs().sum(0) == 0).nonzero()[0])  # a latent off on every token here
    active = int(z.abs().sum(0).argmax())
    with torch.no_grad():
        with lens.steer(Clamp(sae, silent, 0.0, site=SITE)):  # clamped to its current value
            assert (model(**inputs).logits - bare).abs().max() < 1e-6
    pre, post, _ = _pre_post(lens, model, inputs, [Clamp(sae, active, 5.0, site=SITE)])
    expected = (5.0 - z[:, active])[:, None] * sae.decode(torch.eye(64)[active:active + 1] ) \
        - (5.0 - z[:, active])[:, None] * sae.decode(torch.zeros(1, 64))
    torch.testing.assert_close((post[0] - pre[0]).reshape(-1, 32), expected, atol=1e-4, rtol=1e-4)


def test_code_ablate_removes_the_assigned_code_only(llama):
    model, lens = llama
    inputs = tiny_inputs("llama")
    vq = VQCodebook(8, init_size=64)
    with torch.no_grad(), lens.capture(SITE) as cap:  # fit the codes on this site's own activations
        for seed in range(8):
            vq.update(cap.forward(**tiny_inputs("llama", batch=4, length=12, seed=seed))[0][SITE])
    vq.flush()
    with torch.no_grad(), lens.capture(SITE, keep_shape=True) as cap:
        acts, _ = cap.forward(**inputs)
    common = int(vq.assign(acts[SITE].reshape(-1, 32)).mode().values)
    pre, post, _ = _pre_post(lens, model, inputs, [CodeAblate(vq, [common], site=SITE)])
    x = pre[0].reshape(-1, 32)
    hit = vq.assign(x) == common
    assert hit.any() and (~hit).any()
    delta = (post[0] - pre[0]).reshape(-1, 32)
    torch.testing.assert_close(delta[hit], -vq.quantize(x)[hit])
    assert torch.equal(delta[~hit], torch.zeros_like(delta[~hit]))


@pytest.mark.parametrize("positions", ["prompt", "generated"])
def test_a_chunked_prefill_warns_that_only_its_first_chunk_is_the_prompt(llama, positions):
    """generate(prefill_chunk_size=4) runs a 9-token prompt as chunks of 4, 4 and 1: nothing in the
    forwards tells its later chunks from decoding steps, so the scope says so instead of editing
    them silently as generated. Unchunked, cached or not, it says nothing."""
    model, lens = llama
    inputs = tiny_inputs("llama", length=9)
    gen = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    edit = Add(torch.randn(32), 9.0, site=SITE)
    with pytest.warns(UserWarning, match="4 tokens per row.*prefill_chunk_size"), torch.no_grad(), \
            lens.steer(edit, positions=positions):
        model.generate(**inputs, prefill_chunk_size=4, **gen)
    for use_cache in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.no_grad(), lens.steer(edit, positions=positions):
                model.generate(**inputs, use_cache=use_cache, **gen)
