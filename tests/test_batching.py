"""Hand padding: exact ids, masks and offsets, and the tokenizer left untouched."""

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
