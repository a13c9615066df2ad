"""Token ids as the atlas shows them: each token's text, decoded once per pass, and parts of a
character grouped into whole characters or shown by their bytes.

    texts = whole(tokenizer, [1012, 50256])        # {id: text}, a part of a character as <0xE2 0x80>
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

REPLACEMENT = "\ufffd"  # what a tokenizer's decode shows for bytes that are not a whole character


def chips(tokenizer: Any, ids: list[int], acts: list[float], center: int, vocab: dict[int, str],
          longest: int = 4) -> tuple[list[str], list[float], int]:
    """One window's tokens as text chips. Byte-level tokens that hold part of a character decode
    alone to U+FFFD: a run of them that decodes to whole characters (up to `longest` tokens)
    becomes one chip with the activation largest in magnitude; a part that cannot be completed
    inside the window shows its bytes. Returns (texts, activations, index of the centre's chip)."""
    if not any(REPLACEMENT in vocab[t] for t in ids):
        return [vocab[t] for t in ids], acts, center
    texts, out_acts, out_center, i = [], [], center, 0
    while i < len(ids):
        j = i + 1
        if REPLACEMENT in vocab[ids[i]]:
            while j < len(ids) and j - i < longest and REPLACEMENT in tokenizer.decode(ids[i:j]):
                j += 1
            if REPLACEMENT in tokenizer.decode(ids[i:j]):
                j = i + 1
        text = tokenizer.decode(ids[i:j]) if j > i + 1 else vocab[ids[i]]
        texts.append(byte_text(tokenizer, ids[i]) if REPLACEMENT in text else text)
        out_acts.append(max(acts[i:j], key=abs))
        if i <= center < j:
            out_center = len(texts) - 1
        i = j
    return texts, out_acts, out_center


def byte_text(tokenizer: Any, token_id: int) -> str:
    """A token that is part of a character, shown by its bytes: `<0xE2 0x80>` for a byte-level BPE
    piece (GPT-2's byte-to-character table), the tokenizer's own piece for SentencePiece byte
    tokens (`<0xE2>`), else the id in angle brackets."""
    piece = tokenizer.convert_ids_to_tokens(token_id) if hasattr(tokenizer, "convert_ids_to_tokens") else None
    if not isinstance(piece, str) or not piece:
        return f"<{token_id}>"
    if piece.startswith("<0x") and piece.endswith(">"):
        return piece
    table = _byte_of_character()
    if all(ch in table for ch in piece):
        return "<" + " ".join(f"0x{table[ch]:02X}" for ch in piece) + ">"
    return f"<{token_id}>"


@functools.cache
def _byte_of_character() -> dict[str, int]:
    """GPT-2's byte-level BPE table, character -> byte (built once: it was most of `byte_text`'s time)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {ch: b for b, ch in bytes_to_unicode().items()}


def decoder(tokenizer: Any, ids: Sequence[int], known: dict[int, str] | None = None) -> dict[int, str]:
    """Token id -> its text (`tokenizer.decode([id])`; the id in angle brackets when it cannot decode).
    A token that decodes to U+FFFD alone (part of a character) keeps that text here: `chips` groups
    it with its neighbours in a context, `whole` (used for single tokens) shows its bytes. `known`:
    texts of this tokenizer decoded before (filled here; a pass shares one across its sets, whose
    contexts and promoted tokens repeat ids: a Python call per id was most of the decoding)."""
    decode = getattr(tokenizer, "decode", None)
    if not callable(decode):
        return {i: f"<{i}>" for i in ids}
    known = {} if known is None else known
    for i in ids:
        if i not in known:
            known[i] = decode([i])
    return {i: known[i] for i in ids}


def whole(tokenizer: Any, ids: Sequence[int], known: dict[int, str] | None = None) -> dict[int, str]:
    """Token id -> text for tokens shown alone (promoted / suppressed, largest norms); a part of a
    character shows its bytes."""
    return {i: byte_text(tokenizer, i) if REPLACEMENT in t else t for i, t in decoder(tokenizer, ids, known).items()}
