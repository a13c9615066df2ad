"""Dose-response sweeps on a tiny random Llama with an in-memory word-level tokenizer."""

from __future__ import annotations

import pytest
import torch

import conceptlens
from conceptlens.steering import Add, sweep, token_logprob
from conceptlens.steering.sweep import Generation
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
