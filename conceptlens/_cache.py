"""Where conceptlens keeps files it makes once (fp32 model copies, fetched corpora)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """`$CONCEPTLENS_CACHE` (default `~/.cache/conceptlens`) joined with `parts`; not created."""
    root = os.environ.get("CONCEPTLENS_CACHE") or Path.home() / ".cache" / "conceptlens"
    return Path(root).expanduser().joinpath(*parts)
