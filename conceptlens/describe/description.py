"""Description: what one concept set's concepts are, saved as `describe/<NAME>/` of a run.

    d = Description.load("runs/demo/describe/topk")
    d.info["n_concepts"], d.stats["top_values"], d.contexts[12]["contexts"][0]["tokens"]
    d.save(folder)

Layout (the contract with the report): `description.json` (info), `stats.safetensors`
(per-concept tensors), `contexts.jsonl` (one line per concept, in order) and, for decoder
models, `tokens.json` (promoted / suppressed tokens as strings).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file
from torch import Tensor

from conceptlens._content import parse_json, read_json
from conceptlens._io import atomic_write

FORMAT = "conceptlens.Description"
VERSION = 1
FILES = ("description.json", "stats.safetensors", "contexts.jsonl", "tokens.json")


@dataclass
class Description:
    """One concept set's description: `info` (JSON), `stats` (tensors, first dim n), `contexts`
    (per concept: its top windows with decoded tokens and activations), `tokens` (decoders)."""

    info: dict[str, Any]
    stats: dict[str, Tensor]
    contexts: list[dict[str, Any]]
    tokens: dict[str, list[list[str]]] | None = field(default=None)

    def __repr__(self) -> str:
        i = self.info
        return (f"Description({i.get('name')!r}, n={i.get('n_concepts')}, site={i.get('site')!r}, "
                f"tokens={i.get('tokens')}, documents={i.get('documents')})")

    def save(self, folder: str | os.PathLike) -> Path:
        """Write the four files into `folder`, each atomically; description.json goes first and comes
        back last, so a save killed half-way leaves no description (a rerun writes it), never new
        statistics under an earlier description.json."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / FILES[0]).unlink(missing_ok=True)
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.stats.items()}
        atomic_write(folder / FILES[1], lambda p: save_file(tensors, p, metadata={"format": FORMAT}))
        lines = "".join(json.dumps(c, separators=(",", ":")) + "\n" for c in self.contexts)
        atomic_write(folder / FILES[2], lambda p: Path(p).write_text(lines, encoding="utf-8"))
        if self.tokens is not None:
            text = json.dumps(self.tokens, ensure_ascii=False)
            atomic_write(folder / FILES[3], lambda p: Path(p).write_text(text, encoding="utf-8"))
        elif (folder / FILES[3]).exists():
            (folder / FILES[3]).unlink()
        info = json.dumps({"format": FORMAT, "version": VERSION, **self.info}, indent=1, ensure_ascii=False)
        atomic_write(folder / FILES[0], lambda p: Path(p).write_text(info, encoding="utf-8"))  # last: marks done
        return folder

    @classmethod
    def load(cls, folder: str | os.PathLike) -> Description:
        folder = Path(folder)
        for name in FILES[:3]:
            if not (folder / name).is_file():
                raise FileNotFoundError(f"{folder / name} not found: a description folder holds {', '.join(FILES[:3])}")
        info = read_json(folder / FILES[0])
        if not isinstance(info, dict) or info.get("format") != FORMAT or info.get("version") != VERSION:
            raise ValueError(f"{folder / FILES[0]} is not a {FORMAT} version {VERSION} file")
        with open(folder / FILES[2], encoding="utf-8") as f:
            contexts = [parse_json(line, folder / FILES[2]) for line in f if line.strip()]
        tokens_path = folder / FILES[3]
        tokens = read_json(tokens_path) if tokens_path.is_file() else None
        info = {k: v for k, v in info.items() if k not in ("format", "version")}
        return cls(info, load_file(folder / FILES[1]), contexts, tokens)
