"""Edits run before reads at a site whatever the scope order; q/k/v edits agree with and
without the KV cache."""

from __future__ import annotations

import pytest
import torch

import conceptlens
from conceptlens.steering import Add
from tests.conftest import Batches, tiny_model

SITE = "blocks.0.resid_out"


def test_a_capture_reads_after_the_edit_whatever_the_scope_order():
    model = tiny_model("llama")
    lens = conceptlens.attach(model)
    ids = torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(0))
    vector = torch.randn(32)
    bare, early, late, middle = Batches(), Batches(), Batches(), Batches()
    with torch.no_grad(), lens.capture(SITE, keep_shape=True, on_batch=bare):
        model(input_ids=ids)
    expected = bare.acts[SITE] + vector
    with torch.no_grad():
        with lens.capture(SITE, keep_shape=True, on_batch=early), lens.steer(Add(vector, site=SITE)):
            model(input_ids=ids)
        with lens.steer(Add(vector, site=SITE)), lens.capture(SITE, keep_shape=True, on_batch=late):
            model(input_ids=ids)
        # a capture opened between two steering scopes: entering the second re-registers the edits
        other = "blocks.1.resid_out"
        with lens.steer(Add(vector, site=SITE)), lens.capture(SITE, keep_shape=True, on_batch=middle), \
                lens.steer(Add(torch.randn(32), 0.0, site=other)):
            model(input_ids=ids)
    for seen in (early, late, middle):
        torch.testing.assert_close(seen.acts[SITE], expected, rtol=0, atol=1e-6)


def test_q_k_v_read_after_their_edit():
    model = tiny_model("llama")
    lens = conceptlens.attach(model)
    ids = torch.randint(3, 99, (1, 5), generator=torch.Generator().manual_seed(1))
    for which in "qkv":
        site = f"blocks.0.attn.{which}"
        width = lens.site(site).shape[2] * lens.site(site).shape[3]
        vector = torch.randn(width)
        bare, seen = Batches(), Batches()
        with torch.no_grad(), lens.capture(site, keep_shape=True, on_batch=bare):
            model(input_ids=ids)
        with torch.no_grad(), lens.capture(site, keep_shape=True, on_batch=seen), lens.steer(Add(vector, site=site)):
            model(input_ids=ids)
        torch.testing.assert_close(seen.acts[site], bare.acts[site] + vector.view(lens.site(site).shape[2], -1),
                                   rtol=0, atol=1e-6)


def _generate(model, lens, edit, positions, use_cache):
    ids = torch.randint(3, 99, (2, 5), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :1] = 0  # left padding on one row
    with torch.no_grad(), lens.steer(edit, positions=positions):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                             use_cache=use_cache, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("positions", ["all", "prompt", "generated", slice(2, 6)], ids=str)
def test_qkv_edits_same_tokens_and_logits_with_and_without_cache(family, which, positions):
    model = tiny_model(family)
    lens = conceptlens.attach(model)
    site = lens.site(f"blocks.0.attn.{which}")
    vector = torch.randn(site.shape[2] * site.shape[3], generator=torch.Generator().manual_seed(3)) * 3
    edit = Add(vector, site=site.name)
    cached, cached_scores = _generate(model, lens, edit, positions, True)
    fresh, fresh_scores = _generate(model, lens, edit, positions, False)
    _, bare_scores = _generate(model, lens, Add(vector, 0.0, site=site.name), positions, True)
    assert torch.equal(cached, fresh)
    torch.testing.assert_close(cached_scores, fresh_scores, rtol=0, atol=1e-5)
    if not (which == "k" and positions == "all"):  # one vector added to every key shifts all scores alike
        assert not torch.allclose(cached_scores, bare_scores, atol=1e-4)  # the edit does something


def test_steering_the_pattern_site_is_refused_before_any_hook():
    model = tiny_model("llama")
    lens = conceptlens.attach(model)
    with pytest.raises(ValueError, match="read only"):
        lens.steer(Add(torch.randn(4), site="blocks.0.attn.pattern"))
