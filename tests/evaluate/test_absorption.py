"""First-letter absorption finds a planted absorbing latent; main latents, vocabulary per tokenizer family."""

import pytest
import torch

from conceptlens.evaluate.absorption import LETTERS, absorption, alpha_tokens, main_latents


def _words():
    """Latent 0 fires on 's' words, latent 2 on 'a' words; 'short' (row 0) fires latent 1 instead of 0.

    Decoder rows: 0 -> e0 (the 's' direction), 1 -> (e0 + e1) / sqrt 2, 2 -> e2, 3 -> e3 (noise)."""
    g = torch.Generator().manual_seed(0)
    words = ["short"] + [f"s{i}" for i in range(39)] + [f"a{i}" for i in range(40)]
    letter = torch.tensor([LETTERS.index(w[0]) for w in words])
    decoder = torch.eye(4, 8)
    decoder[1] = (torch.eye(8)[0] + torch.eye(8)[1]) / 2 ** 0.5
    z = torch.zeros(len(words), 4)
    z[1:40, 0] = 3.0
    z[0, 1] = 3.0
    z[40:, 2] = 3.0
    z[:, 3] = torch.rand(len(words), generator=g)
    return words, letter, z, decoder


def test_a_planted_absorbing_latent_is_found():
    words, letter, z, decoder = _words()
    x = z @ decoder
    s = letter == LETTERS.index("s")
    result = absorption(x[s], z[s], decoder, torch.eye(8)[0], main=[0])
    assert result.fraction.tolist() == [1.0] + [0.0] * 39  # 'short' absorbed entirely, the rest not at all
    assert result.full.tolist() == [True] + [False] * 39
    assert int(result.top[0]) == 1  # the absorbing latent
    partly = z[s][:1].clone()
    partly[0, 0] = 1.0  # the main latent fires weakly: partial absorption, no full absorption
    part = absorption(partly @ decoder, partly, decoder, torch.eye(8)[0], main=[0])
    share = 3 / 2 ** 0.5
    assert part.fraction.item() == pytest.approx(share / (share + 1.0)) and not part.full.item()


def test_main_latents_are_the_letters_latent():
    words, letter, z, _ = _words()
    y = (letter == LETTERS.index("s")).long()
    assert main_latents(z[::2], y[::2], z[1::2], y[1::2], max_k=4) == [0]


class _Tokenizer:
    vocab = ["<s>", " apple", " a", "Banana", " be", " x1", " cat"]

    def __len__(self):
        return len(self.vocab)

    def decode(self, ids):
        return "".join(self.vocab[i] for i in ids)


def test_alpha_tokens_keep_spaced_words_of_two_or_more_letters():
    assert alpha_tokens(_Tokenizer(), 10) == [(1, "apple"), (4, "be"), (6, "cat")]
    assert len(alpha_tokens(_Tokenizer(), 2)) == 2


def _fast(model):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(model), unk_token="[UNK]")


def test_wordpiece_words_are_the_pieces_without_the_continuation_prefix():
    from tokenizers.models import WordPiece

    vocab = ["[UNK]", "[CLS]", "apple", "##s", "be", "x", "##ing", "Cat", "a1", "##ly"]
    tok = _fast(WordPiece({v: i for i, v in enumerate(vocab)}, unk_token="[UNK]"))
    assert alpha_tokens(tok, 10) == [(2, "apple"), (4, "be"), (7, "Cat")]


def test_sentencepiece_and_byte_level_words_follow_their_space_mark():
    from tokenizers.models import BPE

    vocab = ["[UNK]", "\u2581apple", "apple", "\u2581a", "ing", "\u0120cat", "\u2581be"]
    tok = _fast(BPE({v: i for i, v in enumerate(vocab)}, [], unk_token="[UNK]"))
    assert alpha_tokens(tok, 10) == [(1, "apple"), (5, "cat"), (6, "be")]


def test_a_vocabulary_without_words_is_a_one_line_error():
    tok = _Tokenizer()
    tok.vocab = ["<s>", " a", "Banana", " x1"]
    with pytest.raises(ValueError, match=r"no whole-word tokens in the vocabulary of _Tokenizer .*' '") as err:
        alpha_tokens(tok, 10)
    assert "\n" not in str(err.value)


def test_decoder_rows_are_each_latents_unit_contribution_read_in_chunks():
    from conceptlens.evaluate.absorption import decoder_rows

    g = torch.Generator().manual_seed(0)
    W, b = torch.randn(7, 5, generator=g), torch.randn(5, generator=g)
    calls = []

    def decode(z):
        calls.append(z.shape[0])
        return torch.relu(z) @ W + b  # a latent's row is decode(e_i) - decode(0)

    assert torch.equal(decoder_rows(decode, 7, chunk=3), (torch.eye(7) @ W + b) - b)
    assert calls == [1, 3, 3, 1]  # the bias, then at most 3 one-hot codes at a time


def test_fewer_words_than_a_test_split_needs_is_a_one_line_error():
    from conceptlens.evaluate.absorption import absorption_lines

    words = [(i, w) for i, w in enumerate(["apple", "bird", "cat", "dog"])]  # a fifth of 4 is no test word
    with pytest.raises(ValueError, match="absorption needs at least 5 words .*; got 4: pass --absorption-words 5"):
        absorption_lines(None, "blocks.0.resid_out", {}, None, words)


def test_no_probe_true_positive_is_named_as_the_reason_for_no_figure(monkeypatch):
    """Too few words: no letter probe fires on its letter's test words, and the figures (over true
    positives) are NaN; the note says why and what to change (a bare nan before)."""
    import math

    from conceptlens.evaluate import absorption as ab
    from conceptlens.evaluate.activations import ConceptEncoder

    words, _, z, decoder = _words()
    monkeypatch.setattr(ab, "word_activations", lambda lens, site, tok, ids: z @ decoder)
    monkeypatch.setattr(ab, "letter_probe", lambda x, y: ab.LetterProbe(torch.zeros(x.shape[1]).double(), -1.0))
    enc = ConceptEncoder("sae", lambda x: x @ decoder.T, lambda c: c @ decoder)
    lines = ab.absorption_lines(None, "blocks.0.resid_out", {"sae": enc}, None, list(enumerate(words)))
    assert [math.isnan(line.value.value) for line in lines] == [True, True]
    why = "no figure: no letter probe found its letter in any of the 16 test words (probes learnt from 64; " \
          "more --absorption-words)"
    assert all(line.note.endswith(why) for line in lines)
