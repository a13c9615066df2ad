"""Steering SmolLM2 along its own unembedding of ' wedding' raises that word's probability."""

from __future__ import annotations

import pytest
import torch

import conceptlens
from conceptlens import models
from conceptlens.steering import Add, sweep, token_logprob

SITE = "blocks.15.resid_out"  # median token norm ~175 there: useful alphas are tens


@pytest.mark.real_model
def test_word_direction_raises_the_word_monotonically():
    model, tok = models.load("smollm2-135m")
    lens = conceptlens.attach(model, tok)
    (word,) = tok(" wedding", add_special_tokens=False)["input_ids"]
    direction = model.get_output_embeddings().weight[word].detach()
    direction = direction / direction.norm()
    result = sweep(lens, lambda a: Add(direction, a, site=SITE), [0, 20, 40, 80],
                   ["I went to the shop and", "The weather today is"], token_logprob(tok, " wedding"),
                   positions="all", max_new_tokens=8)
    assert result.scores.shape == (4, 2)
    assert (result.mean.diff() > 0).all(), result.table()
    assert (result.scores[-1] > result.scores[0]).all(), result.table()  # every prompt, not only the mean
    with torch.no_grad():  # alpha 0 is the bare model
        ids = tok(["I went to the shop and"], return_tensors="pt")
        bare = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert result.texts[0][0] == tok.decode(bare[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
