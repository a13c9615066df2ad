"""Argument types for the subcommands: a user's mistake is caught while parsing, before a
model loads, and reported in one line (`conceptlens CMD: error: ...`, exit code 2).

    parser.add_argument("--alpha", type=finite_float, default=8.0)
    parser.add_argument("--data", type=data_source, default="bbc-news")
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


INT64_MAX = 2**63 - 1
MAX_THREADS = 1024


def _int(text: str, low: int, what: str, high: int = INT64_MAX) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} is not {what} (must be >= {low})")
    if value > high:
        raise argparse.ArgumentTypeError(f"{value} is too large (at most {high}{' (int64)' if high == INT64_MAX else ''})")
    return value


def positive_int(text: str) -> int:
    return _int(text, 1, "a positive integer")


def token_length(text: str) -> int:
    """Tokens per document: at least 2, since the first position of every document is left out of
    the rows (its norm dwarfs the others') and one token would leave none."""
    return _int(text, 2, "a document length (the first position is left out, so one token leaves none)")


def seed(text: str) -> int:
    """A random seed: an integer in [0, 2**63 - 1] (torch's generators take int64)."""
    return _int(text, 0, "a seed")


def threads(text: str) -> int:
    return _int(text, 1, "a positive integer", MAX_THREADS)


def count(text: str) -> int:
    """An integer >= 0 (0 usually means: skip)."""
    return _int(text, 0, "a count")


def nonempty_text(text: str) -> str:
    if text == "":
        raise argparse.ArgumentTypeError("an empty string; give some text")
    return text


def existing_dir(text: str) -> str:
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text!r} does not exist")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    return text


def concept_dir(text: str) -> str:
    """A saved ConceptSet folder."""
    from conceptlens.concepts.conceptset import TENSOR_FILE

    existing_dir(text)
    if not (Path(text) / TENSOR_FILE).is_file():
        raise argparse.ArgumentTypeError(f"{text!r} holds no saved ConceptSet ({TENSOR_FILE} is missing)")
    return text


def data_source(text: str) -> str:
    """A bundled set name (`name` or `name:split`), or a .txt / .jsonl file with at least one document."""
    from conceptlens.data import SET_NAMES

    name, _, split = text.partition(":")
    if name in SET_NAMES and not Path(text).is_file():  # a folder named like a set (an --out) is no data
        if split not in ("", "train", "test", "all"):
            raise argparse.ArgumentTypeError(f"{text!r}: unknown split {split!r}; use train, test or all")
        return text
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text!r} is neither a file nor a bundled set ({', '.join(SET_NAMES)})")
    if not path.is_file() or path.suffix not in (".txt", ".jsonl"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a .txt (one document per line) or .jsonl file")
    try:
        with open(path, encoding="utf-8-sig") as f:
            has_text = any(line.strip() for line in f)
    except (OSError, UnicodeDecodeError) as err:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {err}") from None
    if not has_text:
        raise argparse.ArgumentTypeError(f"{text!r} is empty: it holds no documents")
    return text


def out_dir(text: str) -> str:
    """A folder that exists or can be created, and can be written to."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder: give a path")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a folder")
    parent = path
    while not parent.exists():  # the nearest existing folder is where a new one would go
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} cannot be created: {str(parent)!r} is a file")
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not writable ({os.strerror(err.errno or 0)} in "
                                         f"{str(parent)!r})") from None
    return text


def out_file(text: str) -> str:
    """A file to write: not a folder, in a folder that exists or can be created and is writable."""
    if text == "":
        raise argparse.ArgumentTypeError("an empty path")
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    try:
        out_dir(str(Path(text).parent))
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written: {err}") from None
    return text


FIGURE_FORMATS = ("png", "pdf", "svg")


def figure_file(text: str) -> str:
    """A figure to write (`out_file`) whose suffix names a format matplotlib saves: .png, .pdf or .svg."""
    out_file(text)  # a folder, or a path that cannot be written, is named as such first
    if Path(text).suffix.lower().lstrip(".") not in FIGURE_FORMATS:
        raise argparse.ArgumentTypeError(f"{text!r} has no figure suffix; end it in "
                                         f"{', '.join('.' + f for f in FIGURE_FORMATS)}")
    return text


def int_list(text: str, flag: str) -> list[int]:
    """'2,1' -> [2, 1] (for an option `flag` that takes comma-separated integers)."""
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers; got {text!r}") from None
