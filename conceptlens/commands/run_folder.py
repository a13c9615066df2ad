"""A run folder holds one run: `fit` into a folder written for another run refuses, or with
`--overwrite` first clears the files that run wrote (and nothing else).

    check(out, cfg)     # ValueError naming what differs from the run the folder holds
    clear(out)          # --overwrite: the files the earlier run wrote, and nothing else

What a run owns (OWNED, relative to the folder): run.toml, checkpoint.pt, fit_report.json,
quality.json, eval.json, each concepts/<NAME>/ ConceptSet's two files, the description pass's checkpoint,
source.json and describe/<NAME>/ files, and hierarchy/<NAME>.json. Any other file stays.
The clear moves those files into `.overwritten.tmp/` inside the folder (renames on one
filesystem) with run.toml last, then deletes that folder: a process killed mid-way leaves
run.toml naming the old run, so the folder is still refused until `--overwrite` runs again.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from conceptlens.commands import run_config as rc

OWNED = ("checkpoint.pt", "fit_report.json", "quality.json", "eval.json", "concepts/*/concepts.safetensors",
         "concepts/*/config.json", "describe/checkpoint.pt", "describe/source.json",
         "describe/*/description.json", "describe/*/stats.safetensors", "describe/*/contexts.jsonl",
         "describe/*/tokens.json", "hierarchy/*.json", "run.toml")
"""Files a run writes, as globs; run.toml last (see the module docstring)."""
TRASH = ".overwritten.tmp"
IDENTITY = ("model", "data", "sites", "shuffle", "extractor")
"""What makes two configs one run (with fit.batch_size and fit.max_length)."""


def check(out: Path, cfg: rc.RunConfig) -> None:
    """Refuse, in one line naming what differs, a folder whose run.toml is another run's."""
    if not (out / "run.toml").is_file():
        return
    old, new = rc.to_dict(rc.from_dict(rc.read_toml(out / "run.toml"))), rc.to_dict(cfg)
    for raw in (old, new):  # run.toml leaves None out (`lr=none` is recorded as no lr)
        raw["extractor"] = [{k: v for k, v in spec.items() if v is not None} for spec in raw["extractor"]]
    differs = [(key, old[key], new[key]) for key in IDENTITY if old[key] != new[key]]
    differs += [(f"fit.{key}", old["fit"][key], new["fit"][key]) for key in ("batch_size", "max_length")
                if old["fit"][key] != new["fit"][key]]
    if differs:
        key, was, now = differs[0]
        raise ValueError(f"{out} holds a run with another {key} ({was!r}, now {now!r}); use another --out, or "
                         "--overwrite to clear that run's files first (other files stay)")


def clear(out: Path) -> list[str]:
    """Remove the run's own files from `out` (see OWNED); return them, relative to `out`."""
    trash = out / TRASH
    shutil.rmtree(trash, ignore_errors=True)  # an earlier clear that was killed mid-way
    moved = []
    for pattern in OWNED:
        for path in sorted(out.glob(pattern)) + sorted(out.glob(_leftover(pattern))):
            if not path.is_file() or path.is_symlink():
                continue
            rel = path.relative_to(out)
            (trash / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, trash / rel)
            moved.append(str(rel))
    inside = {out / parent for rel in moved for parent in Path(rel).parents if parent != Path(".")}
    for folder in sorted(inside, key=lambda p: -len(p.parts)):  # concepts/<NAME>/, then concepts/
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    shutil.rmtree(trash, ignore_errors=True)
    return moved


def _leftover(pattern: str) -> str:
    """The temporary files `atomic_write` leaves for files matching `pattern` (`.NAME.XXXX.tmp`)."""
    head, _, name = pattern.rpartition("/")
    return f"{head + '/' if head else ''}.{name}.*.tmp"
