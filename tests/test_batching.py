"""Hand padding: exact ids, masks and offsets, and the tokenizer left untouched."""

import pytest
import torch

from conceptlens.batching import encode_batch, pad_right


class WordTokenizer:
    """Ids and character spans per whitespace word; no pad token at all."""

    pad_token = None

    def __call__(self, texts, truncation=False, max_length=None, return_offsets_mapping=False):
        ids, spans = [], []
        for text in texts:
            words, start, row_ids, row_spans = text.split(" "), 0, [], []
            for word in words:
                row_ids.append(10 + len(word))
                row_spans.append((start, start + len(word)))
                start += len(word) + 1
            ids.append(row_ids[:max_length] if truncation else row_ids)
            spans.append(row_spans[:max_length] if truncation else row_spans)
        return {"input_ids": ids, **({"offset_mapping": spans} if return_offsets_mapping else {})}


def test_pad_right():
    batch = pad_right([[5, 6, 7], [8], []])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0], [0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    assert pad_right([[], []])["input_ids"].shape == (2, 1)


def test_encode_batch_truncates_pads_and_keeps_offsets():
    tok = WordTokenizer()
    batch = encode_batch(tok, ["a bb ccc dddd", "ee"], max_length=3, offsets=True)
    assert batch["input_ids"].tolist() == [[11, 12, 13], [12, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert torch.equal(batch["offset_mapping"][0], torch.tensor([[0, 1], [2, 4], [5, 8]]))
    assert batch["offset_mapping"][1].tolist() == [[0, 2], [0, 0], [0, 0]]
    assert tok.pad_token is None


def test_a_long_text_is_cut_before_it_is_tokenized_to_the_same_first_tokens():
    """One line of a file may be a book: it is not tokenized whole to keep 128 tokens, and the tokens
    kept are the whole text's (MiniLM's own WordPiece tokenizer, special tokens included)."""
    import random

    from transformers import AutoTokenizer

    from conceptlens import batching, models

    tok = AutoTokenizer.from_pretrained(models._package_dir(models.REGISTRY["minilm-l6"]) / "model")
    words = ["the", "market", "rallied", "sharply,", "while", "analysts", "(cautiously)", "noted", "1,204.5%"]
    rng = random.Random(0)
    book = " ".join(rng.choice(words) for _ in range(200_000))
    spaces = " " * 20_000 + "hello world " * 40  # mostly whitespace: the cut would lose its words
    seen: list[int] = []

    def spy(texts, **kwargs):
        seen.extend(len(t) for t in ([texts] if isinstance(texts, str) else texts))
        assert kwargs["truncation"] is True and kwargs["max_length"] <= 128 + batching.CUT_MARGIN + 1  # no warning
        return tok(texts, **kwargs)                                                 # that a text is too long

    for text in (book, spaces, "short text"):
        seen.clear()
        batch = batching.encode_batch(spy, [text, "short text"], 128, offsets=True)
        whole = tok([text, "short text"], truncation=True, max_length=128, return_offsets_mapping=True)
        assert batch["input_ids"][0, :len(whole["input_ids"][0])].tolist() == whole["input_ids"][0]
        assert batch["offset_mapping"][0, :len(whole["input_ids"][0])].tolist() == [list(s) for s in
                                                                                     whole["offset_mapping"][0]]
        assert max(seen) <= (batching.CHARS_PER_TOKEN * 128 if text is book else len(text))
    assert tok.decode(batching.tokenize(tok, [spaces], 8)["input_ids"][0]) == "[CLS] hello world hello world hello world [SEP]"


def test_the_cut_keeps_a_long_word_whole_and_the_end_a_left_truncating_tokenizer_keeps():
    """WordPiece gives one [UNK] for a word of over 100 characters but pieces for a part of it: a cut
    inside such a word changed the last tokens kept. A tokenizer that truncates on the left keeps the
    text's end, which a cut at the start lost."""
    from transformers import AutoTokenizer

    from conceptlens import batching, models

    path = models._package_dir(models.REGISTRY["minilm-l6"]) / "model"
    tok = AutoTokenizer.from_pretrained(path)
    word = "acgt" * 40  # 160 characters: one [UNK] whole
    for n in (8, 128):
        cut = batching.CHARS_PER_TOKEN * n
        straddling = ("x " * cut)[: cut - 96] + " " + word + " tail"  # the cut falls 95 characters into it
        spaced = "sequence:" + " " * (cut - 104) + word * 2
        for text in (straddling, spaced):
            assert batching.tokenize(tok, [text], n)["input_ids"] == tok([text], truncation=True, max_length=n)["input_ids"]
    left = AutoTokenizer.from_pretrained(path, truncation_side="left")
    book = "the start of a book. " * 500 + "THE END"
    kept = batching.tokenize(left, [book], 8)["input_ids"][0]
    assert kept == left([book], truncation=True, max_length=8)["input_ids"][0]
    assert left.decode(kept, skip_special_tokens=True).endswith("the end")
    seen: list[int] = []  # no whitespace within the cut: the text is tokenized whole (byte BPE splits a word's

    def spy(texts, **kwargs):  # suffix otherwise than the word, and a left cut kept the suffix)
        seen.extend(len(t) for t in ([texts] if isinstance(texts, str) else texts))
        return left(texts, **kwargs)

    spy.truncation_side = "left"
    spaces = [" ", "\u2009", "\u2003", "\u202f", "\u3000"]  # any whitespace: a thin space too (it cut a word)
    for n in (8, 32):
        for space in spaces:
            text = "sequence:" + space * (batching.CHARS_PER_TOKEN * n - 104) + word * 2  # cut 95 chars into it
            for t in (tok, left):
                assert batching.tokenize(t, [text], n)["input_ids"] == t([text], truncation=True, max_length=n)["input_ids"]
    joined = "a " + "b" * 90 + "\x1c" + "b" * 200 + " a" * 200  # BERT deletes \x1c: one word of 291 characters
    assert batching.tokenize(tok, [joined], 4)["input_ids"] == tok([joined], truncation=True, max_length=4)["input_ids"]
    book = "alpha beta gamma " * 400 + "omega end"  # offsets count from the whole text, not from a left cut
    ours = batching.encode_batch(left, [book], 8, offsets=True)["offset_mapping"][0].tolist()
    assert ours == [list(s) for s in left([book], truncation=True, max_length=8,
                                         return_offsets_mapping=True)["offset_mapping"][0]]
    assert book[ours[-2][0]:ours[-2][1]] == "end"
    unspaced = "a few words " + "acgt" * 2000
    assert batching.tokenize(spy, [unspaced], 8)["input_ids"] == left([unspaced], truncation=True,
                                                                      max_length=8)["input_ids"]
    assert seen == [len(unspaced)]


def test_a_max_length_with_no_room_past_the_special_tokens_is_refused():
    """BERT adds [CLS] and [SEP]: its tokenizer does not truncate to 2 at all (it warns and keeps the
    whole document), so max_length 2 would feed documents past the model's positions."""
    import pytest
    from transformers import AutoTokenizer

    from conceptlens import batching, models
    from tests.conftest import tiny_model

    tok = AutoTokenizer.from_pretrained(models._package_dir(models.REGISTRY["minilm-l6"]) / "model")
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"^--max-length=2 leaves no room for text: BertTokenizer(Fast)? adds 2 special "
                                         r"tokens to each; use --max-length >= 3$"):
        batching.check_max_length(model, 2, "--max-length", tok)
    batching.check_max_length(model, 3, "--max-length", tok)
    assert len(tok(["word " * 50], truncation=True, max_length=3)["input_ids"][0]) == 3
    batching.check_max_length(model, 1, "--max-length", WordTokenizer())  # no special tokens: 1 is room


def test_fit_checks_max_length_against_the_tokenizer_it_is_given():
    import pytest
    from transformers import AutoTokenizer

    import conceptlens
    from conceptlens import models
    from conceptlens.concepts.kmeans import StreamingKMeans
    from tests.conftest import tiny_model

    tok = AutoTokenizer.from_pretrained(models._package_dir(models.REGISTRY["minilm-l6"]) / "model")
    lens = conceptlens.attach(tiny_model("llama"))
    with pytest.raises(ValueError, match="max_length=2 leaves no room for text"):
        lens.fit({"blocks.0.resid_out": StreamingKMeans(n_concepts=2)}, ["a text"], tokenizer=tok, max_length=2,
                 progress=False)


@pytest.mark.real_model
def test_a_left_cut_keeps_the_space_byte_bpe_reads_with_the_next_word():
    """SmolLM2's byte BPE: a left cut that starts the kept part after the space splits its first word
    otherwise ('xx' where the whole text has 'xxx'), up to the kept tokens when the word is long."""
    from conceptlens import batching, models

    tok = models.load("smollm2-135m")[1]
    tok.truncation_side = "left"
    for n in (4, 8):
        text = "a " * 300 + "x" * (batching.CHARS_PER_TOKEN * n - 5) + " end"  # the cut falls on the space
        assert batching.tokenize(tok, [text], n)["input_ids"] == tok([text], truncation=True, max_length=n)["input_ids"]
