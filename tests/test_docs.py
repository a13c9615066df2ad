"""DESIGN.md stays short enough to hold in mind, and every file it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "DESIGN.md"
MAX_CHARS = 25_000
_EXTENSIONS = (".py", ".md", ".toml", ".json", ".js", ".txt", ".sh", ".cfg", ".ini")


def named_paths(text: str) -> list[str]:
    """The repository paths a markdown text names in backticks: anything with a file extension
    (`conceptlens/fit.py`, `fit.py`) or a folder (`hooks/`), `{a,b}` expanded; run-folder files
    without a folder (`run.toml`, `checkpoint.pt`) are not repository files and are left out
    unless they are .py."""
    paths = []
    for token in re.findall(r"`([^`\s]+)`", text):
        token = token.rstrip(".,;:")
        if token.endswith("/") or ("/" in token and token.endswith(_EXTENSIONS)) or token.endswith(".py"):
            paths.extend(_expand(token))
    return paths


def _expand(token: str) -> list[str]:
    """`adapters/{a,b}.py` -> [`adapters/a.py`, `adapters/b.py`] (one brace group)."""
    match = re.search(r"\{([^{}]*)\}", token)
    if not match:
        return [token]
    return [token[:match.start()] + part + token[match.end():] for part in match.group(1).split(",")]


def missing(paths: list[str]) -> list[str]:
    """Those of `paths` that match nothing from the repository root or from `conceptlens/`
    (`<NAME>` and `*` are wildcards); an absolute path is a path of one machine, never the repository's."""
    out = []
    for path in paths:
        pattern = re.sub(r"<[^>]*>", "*", path).rstrip("/")
        if not pattern:  # "`/`": a separator, not a path
            continue
        if pattern.startswith("/") or not any(any(base.glob(pattern)) for base in (ROOT, ROOT / "conceptlens")):
            out.append(path)
    return out


def test_design_is_at_most_25k_characters():
    n = len(DESIGN.read_text(encoding="utf-8"))
    assert n <= MAX_CHARS, f"DESIGN.md has {n} characters, more than {MAX_CHARS}: move detail into docstrings"


def test_every_path_design_names_exists():
    paths = named_paths(DESIGN.read_text(encoding="utf-8"))
    assert len(paths) >= 30, f"only {len(paths)} paths found: the extraction no longer reads DESIGN.md"
    assert missing(paths) == [], f"DESIGN.md names files that do not exist: {missing(paths)}"


def test_the_path_check_catches_a_missing_file():
    text = ("see `hooks/points.py`, `fit.py`, `adapters/`, `commands/<name>.py` and `hooks/gone.py`; "
            "`run.toml`; `adapters/{keys,lost}.py`")
    assert named_paths(text) == ["hooks/points.py", "fit.py", "adapters/", "commands/<name>.py", "hooks/gone.py",
                                 "adapters/keys.py", "adapters/lost.py"]
    assert missing(named_paths(text)) == ["hooks/gone.py", "adapters/lost.py"]
