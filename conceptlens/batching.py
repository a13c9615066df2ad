"""Texts to model batches, right-padded by hand: no pad token needed, the tokenizer untouched.

    batch = encode_batch(tokenizer, ["a text", "another"], max_length=128)
    model(**batch)        # input_ids and attention_mask, (B, T); padding is id 0, masked out
"""

from __future__ import annotations

import unicodedata
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from conceptlens._checks import check_int

POSITION_TABLES = ("wpe", "position_embeddings", "embed_positions")
"""Names of the learned position-embedding tables (GPT-2; BERT family; OPT, BART)."""


def pad_right(rows: Sequence[Sequence[int]]) -> dict[str, Tensor]:
    """Token id lists -> `input_ids` (pad 0) and `attention_mask`, both `(B, max len)` long."""
    width = max(1, max((len(row) for row in rows), default=0))
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return {"input_ids": input_ids, "attention_mask": mask}


CHARS_PER_TOKEN = 64
"""A text longer than `CHARS_PER_TOKEN * max_length` characters is cut there before it is tokenized (a
tokenizer reads a whole text before truncating it, and one line of a file may be a whole book): at the
whitespace before the limit (from the end a tokenizer with `truncation_side="left"` keeps, with that
whitespace, which byte BPE reads with the word after it), so no word is cut in two (WordPiece gives one
[UNK] for a word of over 100 characters but pieces for its part; byte BPE splits a word's suffix
otherwise than the word), and only when the cut still holds more than `max_length + CUT_MARGIN` tokens:
the `max_length` kept are then the whole text's. A text without whitespace there, or mostly
whitespace, is tokenized whole."""
CUT_MARGIN = 16


def tokenize(tokenizer: Any, texts: Sequence[str], max_length: int, **extra: Any) -> Any:
    """`tokenizer(texts, truncation=True, max_length=max_length, **extra)`, each long text cut first
    (offsets, when asked for, count from the start of the whole text)."""
    cut = CHARS_PER_TOKEN * max_length
    left = getattr(tokenizer, "truncation_side", "right") == "left"
    dropped = [0] * len(texts)  # characters cut from the start of each text (a left cut)

    def short(i: int, text: str) -> str:
        if len(text) <= cut:
            return text
        end = _cut(text[::-1], cut, keep_space=True) if left else _cut(text, cut, keep_space=False)
        if end is None:  # no whitespace to cut at: a word cut in two tokenizes otherwise
            return text
        part = text[len(text) - end:] if left else text[:end]
        mark = max_length + CUT_MARGIN  # counted up to the mark only (whole, a long part warns of its length)
        if len(tokenizer(part, add_special_tokens=False, truncation=True, max_length=mark + 1)["input_ids"]) <= mark:
            return text
        dropped[i] = len(text) - len(part) if left else 0
        return part

    encoded = tokenizer([short(i, text) for i, text in enumerate(texts)], truncation=True, max_length=max_length,
                        **extra)
    if extra.get("return_offsets_mapping") and any(dropped):
        encoded["offset_mapping"] = [[(a + shift, b + shift) if b > a else (a, b) for a, b in row]
                                     for row, shift in zip(encoded["offset_mapping"], dropped)]
    return encoded


def _cut(text: str, cut: int, *, keep_space: bool) -> int | None:
    """Where to end `text[:cut]`: at `cut` when it falls on whitespace, else at the last whitespace
    before it, which is kept with `keep_space` (a left cut, reversed: byte BPE reads a word's leading
    space with it); None without whitespace before `cut`."""
    if _space(text[cut]):
        return cut + keep_space
    for i in range(cut - 1, 0, -1):
        if _space(text[i]):
            return i + keep_space
    return None


def _space(char: str) -> bool:
    """Whitespace every tokenizer splits words at: space, tab, newline, return and the Unicode space
    separators (BERT's normaliser deletes other control characters, \x1c or \x85, joining the words)."""
    return char in " \t\n\r" or unicodedata.category(char) == "Zs"


def encode_batch(tokenizer: Any, texts: list[str], max_length: int, *, offsets: bool = False) -> dict[str, Tensor]:
    """Tokenize (truncating to `max_length`) and pad; `offsets=True` adds `offset_mapping` (B, T, 2)."""
    extra = {"return_offsets_mapping": True} if offsets else {}
    encoded = tokenize(tokenizer, texts, max_length, **extra)
    batch = pad_right(encoded["input_ids"])
    if offsets:
        spans = torch.zeros(*batch["input_ids"].shape, 2, dtype=torch.long)
        for i, row in enumerate(encoded["offset_mapping"]):
            if len(row):
                spans[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        batch["offset_mapping"] = spans
    return batch


def position_limit(model: nn.Module) -> int | None:
    """Longest sequence a model with learned position embeddings can take (None: no hard
    limit, e.g. rotary or relative positions, which run past their training length)."""
    limits = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and name.rsplit(".", 1)[-1] in POSITION_TABLES:
            n = module.num_embeddings - int(getattr(module, "offset", 0) or 0)  # OPT/BART keep 2 spare rows
            if module.padding_idx is not None:  # RoBERTa counts positions from padding_idx + 1
                n -= module.padding_idx + 1
            limits.append(n)
    return min(limits) if limits else None


def check_max_length(model: nn.Module, max_length: Any, name: str = "max_length", tokenizer: Any = None) -> None:
    """ValueError unless `max_length` is a positive int (not a bool) within the model's position limit
    and, given its tokenizer, above the special tokens it adds to each text (else a tokenizer does not
    truncate at all: BERT's [CLS] and [SEP] leave no room in 2, and it keeps whole documents)."""
    check_int(name, max_length)
    limit = position_limit(model)
    if limit is not None and max_length > limit:
        raise ValueError(f"{name}={max_length} is beyond the position limit of {type(model).__name__}: "
                         f"{limit} tokens (learned position embeddings); use {name} <= {limit}")
    specials = tokenizer.num_special_tokens_to_add() if hasattr(tokenizer, "num_special_tokens_to_add") else 0
    if max_length <= specials:
        raise ValueError(f"{name}={max_length} leaves no room for text: {type(tokenizer).__name__} adds {specials} "
                         f"special tokens to each; use {name} >= {specials + 1}")
