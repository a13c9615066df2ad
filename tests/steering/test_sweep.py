"""Dose-response sweeps on a tiny random Llama with an in-memory word-level tokenizer."""

from __future__ import annotations

import pytest
import torch

import conceptlens
from conceptlens.steering import Add, AddKeepNorm, ProjectOut, sweep, token_logprob
from conceptlens.steering.sweep import Generation, SweepResult
from tests.conftest import tiny_model

PROMPTS = ["w5 w6 w7 w8", "w20 w21", "w40 w41 w42"]


def word_tokenizer():
    """Word-level tokenizer over the tiny models' 99 ids: '<pad>'=0, '<eos>'=1, 'w3'..'w98'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, 99)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


@pytest.fixture
def setup():
    model, tok = tiny_model("llama"), word_tokenizer()
    model.generation_config.eos_token_id = 1
    return model, tok, conceptlens.attach(model, tok)


def _unembedding(model, token: int) -> torch.Tensor:
    return model.get_output_embeddings().weight[token].detach()


def test_one_score_per_alpha_and_prompt_and_a_png(setup, tmp_path):
    model, tok, lens = setup
    direction = _unembedding(model, 50)
    path = tmp_path / "sweep.png"
    result = sweep(lens, lambda a: Add(direction, a, site="final"), [0, 3, 30], PROMPTS,
                   token_logprob(tok, "w50"), max_new_tokens=5, plot=str(path))
    assert result.alphas == [0.0, 3.0, 30.0]
    assert result.scores.shape == (3, 3) and len(result.texts) == 3 and all(len(t) == 3 for t in result.texts)
    torch.testing.assert_close(result.mean, result.scores.mean(1))
    torch.testing.assert_close(result.std, result.scores.std(1, correction=0))
    assert result.mean[2] > result.mean[0]  # adding the word's unembedding after the final norm raises it
    # 30 |w|^2 dwarfs every other logit; the first step comes from the unsteered prompt
    assert all(text.split()[1:] == ["w50"] * 4 for text in result.texts[2])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["sweep.png"]  # no temporary file left
    assert "log p('w50')" in result.table() and len(result.table().splitlines()) == 4


def test_scores_match_a_recomputed_forward(setup):
    """Alpha 0 is bare greedy generation; its logits and the score equal a forward over the output."""
    model, tok, lens = setup
    seen: list[Generation] = []
    score = token_logprob(tok, "w50")

    def record(generation: Generation) -> float:
        seen.append(generation)
        return score(generation)

    result = sweep(lens, lambda a: Add(torch.randn(32), a, site="blocks.0.resid_out"), [0.0], PROMPTS[:1],
                   record, max_new_tokens=4)
    ids = tok(PROMPTS[:1], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        bare = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        logits = model(bare).logits[0, ids.shape[1] - 1:-1]  # (4, V): the logits each new token came from
    (generation,) = seen
    assert torch.equal(generation.tokens, bare[0, ids.shape[1]:])
    assert generation.text == tok.decode(bare[0, ids.shape[1]:])
    torch.testing.assert_close(generation.logits, logits, atol=1e-4, rtol=1e-4)
    expected = logits.log_softmax(-1)[:, 50].mean()
    torch.testing.assert_close(result.scores[0, 0], expected.double(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("positions, length", [("all", 1), ("generated", 2)])
def test_continuations_stop_at_eos(setup, positions, length):
    """Steering hard to <eos>: 'all' ends at once; 'generated' leaves the first step to the prompt."""
    model, tok, lens = setup
    lengths = []
    score = lambda g: lengths.append(len(g.tokens)) or float(len(g.tokens))  # noqa: E731
    result = sweep(lens, lambda a: Add(_unembedding(model, 1), a, site="final"), [100.0], PROMPTS, score,
                   positions=positions, max_new_tokens=6)
    assert lengths == [length] * 3
    if positions == "all":
        assert result.texts == [["", "", ""]]


def test_errors_name_what_is_missing(setup):
    model, tok, lens = setup
    edit = lambda a: Add(torch.randn(32), a, site="final")  # noqa: E731
    with pytest.raises(ValueError, match="tokenizer"):
        sweep(conceptlens.attach(model), edit, [0.0], PROMPTS, len)
    with pytest.raises(ValueError, match="alphas"):
        sweep(lens, edit, [], PROMPTS, len)
    with pytest.raises(ValueError, match="list of strings"):
        sweep(lens, edit, [0.0], "w5 w6", len)
    with pytest.raises(ValueError, match="no tokens"):
        token_logprob(tok, "")
    tok.pad_token = None  # one prompt needs no padding; several do
    assert sweep(lens, edit, [0.0], PROMPTS[:1], len, max_new_tokens=2).scores.shape == (1, 1)
    with pytest.raises(ValueError, match="pad token"):
        sweep(lens, edit, [0.0], PROMPTS, len)


def _result(ppl, alphas=(0.0, 0.5, 1.0, 2.0), reference=None, budget=2.0) -> SweepResult:
    ppl = torch.tensor(ppl, dtype=torch.float64)
    return SweepResult(list(alphas), torch.zeros(ppl.shape, dtype=torch.float64), [["a", "b"]] * len(alphas), "s",
                       ppl, ppl[0] if reference is None else torch.tensor(reference, dtype=torch.float64), budget)


def test_best_alpha_is_the_last_fluent_one_before_the_first_break():
    result = _result([[3.0, 3.0], [4.0, 5.0], [7.0, 9.0], [5.0, 5.5]])
    assert result.fluent == [True, True, False, True]  # medians 3, 4.5, 8, 5.25 against 2 x 3
    assert result.best_alpha == 0.5  # alpha 2 reads fluently again (repetition), but alpha 1 broke first
    assert result._replace(budget=3.0).best_alpha == 2.0
    assert result._replace(perplexity=None).best_alpha is None
    both = _result([[3.0], [9.0], [4.0], [5.0]], alphas=(0.0, 1.0, -1.0, -2.0))
    assert both.best_alpha == -2.0  # each sign walks from 0 on its own
    assert _result([[9.0], [9.0]], alphas=(0.5, 1.0), reference=[3.0]).best_alpha is None


def test_any_edit_with_a_strength_or_a_list_of_them_is_swept_at_each_alpha(setup):
    model, tok, lens = setup
    direction = _unembedding(model, 50)
    both = lambda a: [Add(direction, a, site="final"), AddKeepNorm(direction, a, site="blocks.0.resid_out")]  # noqa: E731
    made = sweep(lens, both, [0.0, 2.0], PROMPTS, token_logprob(tok, ["w50", "w51"]), max_new_tokens=3)
    template = [Add(direction, 7.0, site="final"), AddKeepNorm(direction, 7.0, site="blocks.0.resid_out")]
    fixed = sweep(lens, template, [0.0, 2.0], PROMPTS, token_logprob(tok, ["w50", "w51"]), max_new_tokens=3)
    assert [e.alpha for e in template] == [7.0, 7.0]  # the given edits are left as they were
    assert fixed.texts == made.texts and torch.equal(fixed.scores, made.scores)
    assert made.mean[1] > made.mean[0]  # alpha 2 does steer towards w50
    torch.testing.assert_close(made.reference, made.perplexity[0])  # alpha 0 is the unsteered reference
    with pytest.raises(TypeError, match="ProjectOut has none"):
        sweep(lens, ProjectOut(direction, site="final"), [0.0], PROMPTS, len)


def test_target_words_score_their_summed_probability(setup):
    model, tok, lens = setup
    logits = torch.randn(3, 99, generator=torch.Generator().manual_seed(0))
    generation = Generation("w5", "w6 w7 w8", torch.tensor([6, 7, 8]), logits)
    expected = logits.double().softmax(-1)[:, [50, 51]].sum(-1).log().mean()
    assert token_logprob(tok, ["w50", "w51", "w50"])(generation) == pytest.approx(float(expected), rel=1e-9)
    assert token_logprob(tok, ["w50", "w51"]).label == "log p('w50', 'w51')"


def test_without_alpha_0_the_unsteered_continuations_set_the_budget(setup):
    model, tok, lens = setup
    direction = torch.randn(32, generator=torch.Generator().manual_seed(3))
    judged = []

    def judge(generations):
        judged.append(len(generations))
        return {"length": [len(g.tokens) for g in generations]}

    result = sweep(lens, Add(direction, 1.0, site="blocks.0.resid_out"), [0.5, 1.0], PROMPTS, len,
                   max_new_tokens=3, judge=judge)
    unsteered = sweep(lens, Add(direction, 1.0, site="blocks.0.resid_out"), [0.0], PROMPTS, len, max_new_tokens=3)
    torch.testing.assert_close(result.reference, unsteered.perplexity[0])
    assert judged == [3, 3] and result.judged["length"].shape == (2, 3)
    assert "length" in result.table().splitlines()[0]
    with pytest.raises(ValueError, match="budget"):
        sweep(lens, Add(direction, 1.0, site="final"), [0.0], PROMPTS, len, budget=0.5)


def test_a_plot_name_matplotlib_cannot_save_is_refused_before_any_generation(setup, tmp_path, monkeypatch):
    import importlib

    sweep_module = importlib.import_module("conceptlens.steering.sweep")  # the package's `sweep` is the function
    model, tok, lens = setup
    monkeypatch.setattr(sweep_module, "_generate", lambda *a, **k: pytest.fail("generated before the name was checked"))
    with pytest.raises(ValueError, match=r"cannot save a figure as '.*dose.txt': end its name in one of .*\.png"):
        sweep(lens, lambda a: Add(_unembedding(model, 50), a, site="final"), [0, 3], PROMPTS,
              token_logprob(tok, "w50"), max_new_tokens=2, plot=str(tmp_path / "dose.txt"))
