"""A run folder holds one run: `fit` into a folder written for another run refuses, or with
`--overwrite` first clears the files that run wrote (and nothing else).

    check(out, cfg)     # ValueError naming what differs from the run the folder holds
    owned(out)          # --overwrite, before the model loads: ValueError unless run.toml is a run's
    clear(out)          # --overwrite, once the sites are checked: the files that run wrote, and nothing else

What a run owns (OWNED, relative to the folder): run.toml, checkpoint.pt, fit_report.json,
quality.json, eval.json, steering.json (the demo's), each concepts/<NAME>/ ConceptSet's two files,
the description pass's checkpoint, source.json and describe/<NAME>/ files, hierarchy/<NAME>.json, and
the files of its report at report/ that the report's manifest lists (a report of the old concepts
would outlive them). Any other file stays, and so does everything behind a symbolic link (a linked
file or folder is not the run's). A folder without
a run.toml holds no run: nothing is cleared, and it is refused when it holds a file of one of those
names (someone else's, which the run would write over); one whose run.toml is not a run's is refused.
The clear moves those files into `.overwritten.tmp/` inside the folder (renames on one
filesystem) with run.toml last, then deletes that folder: a process killed mid-way leaves
run.toml naming the old run, so the folder is still refused until `--overwrite` runs again.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from conceptlens.commands import run_config as rc

if TYPE_CHECKING:
    from conceptlens.concepts.conceptset import ConceptSet

OWNED = ("checkpoint.pt", "fit_report.json", "quality.json", "eval.json", "steering.json",
         "concepts/*/concepts.safetensors", "concepts/*/config.json", "describe/checkpoint.pt", "describe/source.json",
         "describe/*/description.json", "describe/*/stats.safetensors", "describe/*/contexts.jsonl",
         "describe/*/tokens.json", "hierarchy/*.json", "run.toml")
"""Files a run writes, as globs; run.toml last (see the module docstring)."""
REPORT = "report"
"""`conceptlens report`'s default folder: the files its manifest lists are the run's too."""
TRASH = ".overwritten.tmp"
IDENTITY = ("model", "data", "sites", "shuffle", "extractor", "dtype")
"""What makes two configs one run (with fit.batch_size and fit.max_length)."""


def check(out: Path, cfg: rc.RunConfig) -> None:
    """Refuse, in one line naming what differs, a folder whose run.toml is another run's (or, without
    one, that holds files of a run's names: `refuse_foreign`)."""
    if not (out / "run.toml").is_file():
        refuse_foreign(out)
        return
    # as TOML holds them: a tuple option (betas=0.9/0.99) reads back as a list
    old, new = (json.loads(json.dumps(rc.to_dict(c))) for c in (rc.from_dict(rc.read_toml(out / "run.toml")), cfg))
    for raw in (old, new):  # run.toml leaves None out (`lr=none` is recorded as no lr)
        raw["extractor"] = [{k: v for k, v in spec.items() if v is not None} for spec in raw["extractor"]]
    differs = [(key, old[key], new[key]) for key in IDENTITY if old[key] != new[key]
               and not (key in ("model", "data") and _same_path(old[key], new[key]))]
    differs += [(f"fit.{key}", old["fit"][key], new["fit"][key]) for key in ("batch_size", "max_length")
                if old["fit"][key] != new["fit"][key]]
    if differs:
        key, was, now = differs[0]
        raise ValueError(f"{out} holds a run with another {key} ({was!r}, now {now!r}); use another --out, or "
                         "--overwrite to clear that run's files first (other files stay)")


def _same_path(a: object, b: object) -> bool:
    """Whether two spellings of a model or data source name one local file or folder (`tiny`, `tiny/`,
    `./tiny`, its absolute path); a registered or hub name is only ever equal to itself."""
    if not (isinstance(a, str) and isinstance(b, str)):
        return False
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def run_of(path: Path) -> Path:
    """The run folder of `path`: itself, or for a set folder of a run (RUN/concepts/NAME) that run."""
    from conceptlens.concepts.conceptset import CONFIG_FILE

    run = path.parent.parent
    if (path / CONFIG_FILE).is_file() and path.parent.name == "concepts" and (run / "run.toml").is_file():
        return run
    return path


def model_of(folder: str | Path, concepts: ConceptSet) -> str:
    """The model a saved set was fitted on: the one its run's run.toml names (a local model, GGUF file
    included, by its whole path), else the one the set names; a one-line error when neither does."""
    run = run_of(Path(folder))
    if run != Path(folder):  # a set of a run
        model = rc.read_toml(run / "run.toml").get("model")
        if isinstance(model, str) and model.strip():
            return model
    if not concepts.model:
        raise ValueError(f"{folder} names no model: pass --model")
    return concepts.model


def owned(out: Path) -> list[Path]:
    """The files of the run `out` holds (see OWNED), relative to `out`, run.toml last: none when it has
    no run.toml; a one-line ValueError when its run.toml is not a run's."""
    recorded = out / "run.toml"
    if not recorded.is_file():
        refuse_foreign(out)
        return []
    if recorded.is_symlink():
        return []
    try:
        rc.from_dict(rc.read_toml(recorded))
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # not the settings of a run
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{recorded} is not a conceptlens run's ({why}); --overwrite clears only the files "
                         "of a run: use another --out") from None
    found = []
    for pattern in OWNED:  # glob follows linked folders: any linked part of the path leaves the file alone
        paths = sorted(out.glob(pattern)) + sorted(out.glob(_leftover(pattern)))
        if pattern == "run.toml":  # before it: the files of the run's report (at RUN/report, this run's)
            paths = [out / rel for rel in _report_files(out)] + paths
        for path in paths:
            rel = path.relative_to(out)
            if path.is_file() and not any((out / part).is_symlink() for part in (*rel.parents[:-1], rel)):
                found.append(rel)
    return found


def refuse_foreign(out: Path) -> None:
    """A folder without run.toml holds no run, so a file in it of a name a run writes (OWNED: a
    checkpoint.pt, quality.json, concepts/*/config.json, ...) is someone else's, which a fit there would
    write over, read as its own, or clear with a later --overwrite: a one-line ValueError naming it."""
    if not out.is_dir():
        return
    for pattern in OWNED[:-1]:
        for path in sorted(out.glob(pattern)):
            if path.is_file() or path.is_symlink():
                raise ValueError(f"{out} holds {path.relative_to(out)} but no run.toml: a file no run wrote there, "
                                 "which a run would write over or later clear as its own; use another --out "
                                 "(a new or empty folder)")


def _report_files(out: Path) -> list[Path]:
    """The files of the report at RUN/report that its manifest lists (`report.output`), relative to `out`;
    none when it holds no valid manifest."""
    from conceptlens.report.output import _entries, _manifest

    if (out / REPORT).is_symlink():
        return []
    try:  # at RUN/report it is the run's, as `report` rebuilds it, wherever it was made (a moved or copied run)
        listed, _ = _manifest(out / REPORT)
    except ValueError:
        return []
    # the files found there (no link followed) that the list names: a listed "../run.toml" is none of them
    return [Path(REPORT) / rel for rel in sorted(listed & set(_entries(out / REPORT)))]


def clear(out: Path) -> list[str]:
    """Remove the run's own files from `out` (`owned`); return them, relative to `out`."""
    trash = out / TRASH
    shutil.rmtree(trash, ignore_errors=True)  # an earlier clear that was killed mid-way
    moved = []
    for rel in owned(out):
        (trash / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(out / rel, trash / rel)
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
