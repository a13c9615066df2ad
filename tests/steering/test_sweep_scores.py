"""Fluency (perplexity under the unsteered model) and concept expression, against HF's own loss."""

from __future__ import annotations

import math

import pytest
import torch

from conceptlens.steering import Add, robust_norm, sweep, token_logprob
from conceptlens.steering.sweep import Generation
from conceptlens.steering.sweep_scores import ConceptExpression, continuation_perplexity
from tests.steering.test_sweep import PROMPTS, setup  # noqa: F401  (fixture)


def _generation(tok, prompt: str, words: str) -> Generation:
    tokens = torch.tensor(tok(words, add_special_tokens=False)["input_ids"])
    return Generation(prompt, words, tokens, torch.zeros(len(tokens), 99))


def test_perplexity_equals_hf_loss_on_the_continuation_only(setup):  # noqa: F811
    model, tok, _ = setup
    generations = [_generation(tok, "w5 w6 w7", "w9 w10"), _generation(tok, "w20", "w30 w31 w32 w33"),
                   _generation(tok, "w40 w41", "")]
    ppl = continuation_perplexity(model, tok, generations)
    for g, value in zip(generations[:2], ppl[:2]):
        prompt = tok(g.prompt)["input_ids"]
        ids = torch.tensor([prompt + g.tokens.tolist()])
        labels = ids.clone()
        labels[0, :len(prompt)] = -100  # HF shifts labels inside: these mask the prompt's own tokens
        with torch.no_grad():
            loss = model(ids, labels=labels).loss
        assert float(value) == pytest.approx(math.exp(float(loss)), rel=1e-5)
    assert math.isnan(ppl[2])


def test_sweep_reports_fluency_next_to_the_score(setup):  # noqa: F811
    model, tok, lens = setup
    with torch.no_grad():
        model.lm_head.weight.mul_(10)  # a confident model: its own greedy text reads fluently
    direction = model.get_output_embeddings().weight[50].detach().clone()
    result = sweep(lens, lambda a: Add(direction, a, scale="robust_norm", site="final"), [0, 2, 20], PROMPTS,
                   token_logprob(tok, "w50"), max_new_tokens=5)
    assert result.perplexity.shape == (3, 3) and (result.perplexity > 1).all()
    assert result.median_perplexity[2] > 3 * result.median_perplexity[0]  # "w50 w50 ..." reads badly unsteered
    assert "perplexity" in result.table().splitlines()[0]
    assert sweep(lens, lambda a: Add(direction, a, site="final"), [0], PROMPTS, len, max_new_tokens=2,
                 fluency=False).perplexity is None


def test_concept_expression_by_hand(setup):  # noqa: F811
    model, tok, lens = setup
    g = torch.Generator().manual_seed(0)
    direction, mean = torch.randn(32, generator=g), torch.randn(32, generator=g)
    score = ConceptExpression(lens, direction, "blocks.0.resid_out", mean=mean)
    generation = _generation(tok, "w5 w6", "w7 w8 w9")
    with torch.no_grad():
        hidden = model(torch.tensor([[5, 6, 7, 8, 9]]), output_hidden_states=True).hidden_states[1][0, 2:]
    unit = direction / direction.norm()
    expected = float(((hidden - mean) @ unit).mean()) / robust_norm(lens, "blocks.0.resid_out")
    assert score(generation) == pytest.approx(expected, rel=1e-4)
    with pytest.raises(ValueError, match="nonzero norm"):
        ConceptExpression(lens, torch.zeros(32), "blocks.0.resid_out")
