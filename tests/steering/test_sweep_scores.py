"""Fluency (perplexity under the unsteered model) and concept expression, against HF's own loss."""

from __future__ import annotations

import math

import pytest
import torch

from conceptlens.steering import Add, robust_norm, sweep, token_logprob
from conceptlens.steering.sweep import Generation, SweepResult
from conceptlens.steering.sweep_scores import ConceptExpression, continuation_perplexity, repetition
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


def test_chunked_perplexity_equals_the_full_float64_log_softmax(setup):  # noqa: F811
    model, tok, _ = setup
    generations = [_generation(tok, "w5 w6 w7", "w9 w10 w11"), _generation(tok, "w20", "w30 w31 w32 w33 w34"),
                   _generation(tok, "w40 w41", ""), _generation(tok, "w50 w51 w52 w53", "w60")]
    expected = []
    with torch.no_grad():  # one row at a time, every position's distribution in float64
        for g in generations:
            prompt = tok(g.prompt)["input_ids"]
            ids = torch.tensor([prompt + g.tokens.tolist()])
            logprobs = model(ids).logits[0].double().log_softmax(-1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
            new = logprobs[len(prompt) - 1:]
            expected.append(math.exp(-float(new.mean())) if len(new) else math.nan)
    expected = torch.tensor(expected, dtype=torch.float64)
    for chunk in (1, 3, 256):  # chunks cut across rows
        torch.testing.assert_close(continuation_perplexity(model, tok, generations, chunk=chunk), expected,
                                   rtol=1e-6, atol=0, equal_nan=True)


def test_a_large_vocabulary_reads_fewer_logit_rows_at_a_time_with_the_same_perplexities(setup, monkeypatch):  # noqa: F811
    """`CHUNK_BYTES` bounds each float64 copy (Gemma-3's 262,144 logits a row: 32 rows of 64 MiB, not 256)."""
    from conceptlens.steering import sweep_scores

    assert sweep_scores.logit_rows(256, 262_144) == 32 and sweep_scores.logit_rows(256, 49_152) == 170
    assert sweep_scores.logit_rows(256, 2**40) == 1 and sweep_scores.logit_rows(4, 10) == 4
    model, tok, _ = setup
    generations = [_generation(tok, "w5 w6 w7", "w9 w10 w11"), _generation(tok, "w20", "w30 w31 w32 w33 w34")]
    whole = continuation_perplexity(model, tok, generations)
    vocab = model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(sweep_scores, "CHUNK_BYTES", 2 * 8 * vocab)  # two rows a copy
    read = []
    target_logprobs = sweep_scores._target_logprobs
    monkeypatch.setattr(sweep_scores, "_target_logprobs", lambda x, t: read.append(len(x)) or target_logprobs(x, t))
    assert torch.equal(continuation_perplexity(model, tok, generations), whole) and read == [2, 2, 2, 2]


def _tokens(ids) -> Generation:
    return Generation("", "", torch.tensor(ids, dtype=torch.long), torch.zeros(len(ids), 0))


def test_repetition_counts_repeated_3grams_of_hand_made_loops():
    loops = [_tokens([7] * 10),                    # "! ! ! ...": 8 3-grams, 1 distinct
             _tokens([5, 6, 5, 6, 5, 6, 5, 6]),    # period 2: 6 3-grams, 2 distinct
             _tokens([3, 4, 8, 9, 3, 4, 8, 9, 3]),  # period 4: 7 3-grams, 4 distinct
             _tokens(list(range(10, 20))),         # no repeat
             _tokens([3, 3, 4, 4]),                # a repeated token is not a repeated 3-gram
             _tokens([3, 4])]                      # shorter than a 3-gram
    expected = torch.tensor([7 / 8, 4 / 6, 3 / 7, 0.0, 0.0, math.nan], dtype=torch.float64)
    torch.testing.assert_close(repetition(loops), expected, equal_nan=True)


def test_a_loop_that_reads_fluently_is_over_the_budget():
    ppl = torch.tensor([[3.0, 3.0, 3.0], [2.0, 2.5, 2.0], [2.0, 4.0, 4.0]], dtype=torch.float64)
    rep = torch.tensor([[0.1, 0.0, 0.2], [0.9, 0.8, 0.1], [0.6, 0.1, 0.2]], dtype=torch.float64)
    result = SweepResult([0.0, 1.0, 2.0], torch.zeros(3, 3, dtype=torch.float64), [["a"] * 3] * 3, "s", ppl, ppl[0],
                         2.0, None, rep, rep[0])
    # alpha 1 reads more fluently than unsteered by perplexity, but two of its three continuations loop
    assert result._replace(repetition=None).fluent == [True, True, True]
    assert result.fluent == [True, False, True]  # alpha 2: one loop of three, within the budget
    assert result.best_alpha == 0.0
    assert "repeats" in result.table().splitlines()[0]
    # unsteered text that repeats itself more than REPETITION_BUDGET sets the limit
    loopy = result._replace(reference_repetition=torch.tensor([0.9, 0.85, 0.9], dtype=torch.float64))
    assert loopy.fluent == [True, True, True]
