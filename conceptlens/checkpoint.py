"""Fit checkpoints: the state a streaming fit saves and resumes from, and its fingerprint.

    state = FitState(RowFilter(filters), {"blocks.3.resid_out": km}, fit_fingerprint(...))
    texts = state.resume(path, texts)          # texts after the documents already consumed
    state.advance(docs, n_tokens)              # after each batch
    state.save(path)

A checkpoint holds the extractor states, the row filter, the torch RNG state and the data
position. It is written atomically and read with `torch.load(weights_only=True)`, so a
hostile file can fail to load but never runs code.
"""

from __future__ import annotations

import hashlib
import json
from itertools import islice
from pathlib import Path
from typing import Any, Iterator

import torch

from conceptlens._io import atomic_write
from conceptlens.filters import RowFilter

CHECKPOINT = "checkpoint.pt"


class FitState:
    """Everything a checkpoint holds: progress, row filter, RNG state and the extractors."""

    def __init__(self, rows: RowFilter, extractors: dict[str, Any], fingerprint: str) -> None:
        self.rows = rows
        self.extractors = extractors
        self.fingerprint = fingerprint
        self.tokens = self.documents = self.batches = 0

    def advance(self, docs: list[str], n_tokens: int) -> None:
        """Count one batch of documents that has been fed to the extractors."""
        self.documents += len(docs)
        self.batches += 1
        self.tokens += n_tokens

    def save(self, path: Path) -> None:
        state = {
            "fingerprint": self.fingerprint,
            "progress": {"tokens": self.tokens, "documents": self.documents, "batches": self.batches},
            "rows": self.rows.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "extractors": {name: e.state_dict() for name, e in self.extractors.items()},
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: torch.save(state, tmp))

    def resume(self, path: Path, texts: Iterator[str]) -> Iterator[str]:
        """Load the checkpoint at `path`; return `texts` past the documents it had consumed."""
        try:
            state = torch.load(path, weights_only=True)
        except Exception as err:  # noqa: BLE001 - any unreadable file gets the same advice
            raise ValueError(f"cannot read checkpoint {path}: {err}; delete it or pass resume=False") from None
        if state.get("fingerprint") != self.fingerprint:
            raise ValueError(f"checkpoint {path} was written by a fit of another model, data, sites, extractors or "
                             "batching; use another checkpoint_dir or resume=False")
        for name, extractor in self.extractors.items():
            extractor.load_state_dict(state["extractors"][name])
        self.rows.load_state_dict(state["rows"])
        torch.set_rng_state(state["torch_rng"])
        progress = state["progress"]
        self.tokens, self.documents, self.batches = progress["tokens"], progress["documents"], progress["batches"]
        return islice(texts, self.documents, None)


def fit_fingerprint(model: str, data: Any, extractors: dict[str, Any], batching: dict[str, Any]) -> str:
    """What must not change between a checkpoint and its resume (data: its name or path when
    it has one; an in-memory list or iterator cannot be recognised)."""
    what = {
        "model": model, "data": str(data) if isinstance(data, (str, Path)) else type(data).__name__,
        "extractors": sorted((name, type(e).__qualname__) for name, e in extractors.items()),
        **batching,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
