"""Contrastive steering vectors: hand-computed on tiny models and SmolLM2, steering moves a held-out
log-probability, and the same tokens come with and without the KV cache."""

from __future__ import annotations

import pytest
import torch

import conceptlens
from conceptlens.steering import AddKeepNorm, train_vector
from tests.conftest import CharTokenizer, tiny_model

POS = ["I love this, it is wonderful", "What a great day", "This is excellent news", "Such a happy ending"]
NEG = ["I hate this, it is awful", "What a terrible day", "This is dreadful news", "Such a sad ending"]


def _last_hidden(model, tok, texts, layer):
    """HF's own hidden_states[layer + 1] at each text's last token (one text per forward: no padding)."""
    rows = []
    for text in texts:
        ids = torch.tensor([tok(text)["input_ids"][0] if isinstance(tok, CharTokenizer) else
                            tok(text, add_special_tokens=True)["input_ids"]])
        with torch.no_grad():
            hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[layer + 1]
        rows.append(hidden[0, -1])
    return torch.stack(rows)


def test_mean_diff_and_pca_match_a_hand_computation():
    model, tok = tiny_model("llama"), CharTokenizer()
    lens = conceptlens.attach(model, tok)
    vec = train_vector(lens, POS, NEG, sites=["blocks.0.resid_out", "blocks.-1.resid_in"], batch_size=3)
    assert list(vec) == ["blocks.0.resid_out", "blocks.1.resid_in"]
    diffs = _last_hidden(model, tok, POS, 0) - _last_hidden(model, tok, NEG, 0)
    torch.testing.assert_close(vec["blocks.0.resid_out"].directions[0], diffs.mean(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vec["blocks.1.resid_in"].directions, vec["blocks.0.resid_out"].directions)
    pca = train_vector(lens, POS, NEG, sites="blocks.0.resid_out", method="pca")["blocks.0.resid_out"].directions[0]
    _, _, vh = torch.linalg.svd(diffs.double())
    top = vh[0] * torch.sign(diffs.double().mean(0) @ vh[0])
    torch.testing.assert_close(pca.double() / pca.norm(), top, rtol=1e-4, atol=1e-4)
    assert pca @ diffs.mean(0) > 0  # oriented towards the positive prompts


def test_bad_inputs_are_named():
    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    with pytest.raises(ValueError, match="method must be one of"):
        train_vector(lens, POS, NEG, sites="blocks.0.resid_out", method="lda")
    with pytest.raises(ValueError, match="got 4 and 3"):
        train_vector(lens, POS, NEG[:3], sites="blocks.0.resid_out")
    with pytest.raises(KeyError):
        train_vector(lens, POS, NEG, sites="blocks.9.resid_out")


def test_keep_norm_keeps_each_token_norm_and_multi_site_steers_in_one_scope():
    model, tok = tiny_model("llama"), CharTokenizer()
    lens = conceptlens.attach(model, tok)
    vec = train_vector(lens, POS, NEG, sites=["blocks.0.resid_out", "blocks.1.resid_out"])
    edits = vec.edits(alpha=3.0, keep_norm=True)
    assert all(isinstance(e, AddKeepNorm) for e in edits) and len(edits) == 2
    x = torch.randn(2, 5, 32)
    y = edits[0].apply(x, None)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    assert not torch.allclose(y, x)
    ids = torch.tensor([tok("Once upon a time")["input_ids"][0]])
    with torch.no_grad():
        bare = model(input_ids=ids).logits
        with lens.steer(*vec.edits(alpha=3.0)):
            both = model(input_ids=ids).logits
        with lens.steer(*vec.edits(alpha=3.0)[:1]):
            first = model(input_ids=ids).logits
    assert not torch.allclose(both, bare) and not torch.allclose(both, first)


@pytest.mark.real_model
def test_smollm2_vector_moves_held_out_logprob_and_is_cache_consistent():
    from conceptlens import models

    model, tok = models.load("smollm2-135m")
    lens = conceptlens.attach(model, tok)
    site = "blocks.12.resid_out"
    vec = train_vector(lens, POS, NEG, sites=site)
    diffs = _last_hidden(model, tok, POS, 12) - _last_hidden(model, tok, NEG, 12)
    torch.testing.assert_close(vec[site].directions[0], diffs.mean(0), rtol=1e-4, atol=1e-3)

    prompt = tok(["The film was"], return_tensors="pt")
    good, bad = (tok(w, add_special_tokens=False)["input_ids"][0] for w in (" wonderful", " terrible"))

    def margin(alpha: float) -> float:
        with torch.no_grad(), lens.steer(*vec.edits(alpha)):
            logp = model(**prompt).logits[0, -1].log_softmax(-1)
        return float(logp[good] - logp[bad])

    margins = [margin(a) for a in (-4.0, 0.0, 4.0)]
    assert margins[0] < margins[1] < margins[2], margins
    with torch.no_grad(), lens.steer(*vec.edits(4.0)):
        cached = model.generate(**prompt, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
        uncached = model.generate(**prompt, max_new_tokens=10, do_sample=False, use_cache=False,
                                  pad_token_id=tok.pad_token_id)
    assert torch.equal(cached, uncached)
