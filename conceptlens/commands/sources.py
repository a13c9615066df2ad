"""Where `conceptlens fit`, `describe` and `demo` read documents: a bundled set (shuffled by a
seed) or a .txt / .jsonl file, checked without loading any model.

    texts = source("bbc-news", shuffle=0)      # a TextSet in a seeded order
    path = source("docs.txt", shuffle=0)       # the path, once it holds a document
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def source(spec: str, shuffle: int | None) -> Any:
    """A bundled set as a (shuffled) TextSet, else the path; checked without loading any model."""
    from conceptlens import data

    name, _, split = spec.partition(":")
    if name in data.SET_NAMES and not Path(spec).is_file():  # a folder named like a set (an --out) is no data
        texts = data.load(name, split or "train")
        if shuffle is None:
            return texts
        import torch

        order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(shuffle)).tolist()
        return data.TextSet(texts.name, texts.split, [texts.texts[i] for i in order],
                            [texts.labels[i] for i in order], texts.label_names)
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"data {spec!r} is neither a file nor a bundled set; sets: {', '.join(data.SET_NAMES)}")
    if path.suffix not in (".txt", ".jsonl"):
        raise ValueError(f"data file {spec!r} has type {path.suffix!r}; use .txt (one document per line) or .jsonl")
    if not any(text.strip() for text in data.iter_texts(path)):  # reads up to the first document
        raise ValueError(f"data file {spec!r} holds no document: it is empty or blank")
    return str(path)
