"""Where a report may be written: a new or empty folder, or over an earlier report, and nothing
a report did not write is ever removed.

    owned = check_out(run, out)             # refuses the run folder, a folder above it, a symlink,
    staging = new_staging(out)              #   a folder that is not a report; a private new folder
    ... write the pages into staging ...
    commit(staging, out, owned)             # manifest, then the old report swapped out and deleted

A report folder carries `conceptlens-report.json`, the list of the files it wrote and the run it
was made from. An earlier report is replaced only when every file in it is on that list (and none
is a symlink) and it is this run's (or sits at RUN/report); its files are then deleted by that
list, folders only when left empty.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from conceptlens._io import _umask

MANIFEST = "conceptlens-report.json"
FORMAT = "conceptlens.Report"


def check_out(run: Path, out: Path) -> set[str] | None:
    """The files the report at `out` owns (empty: an empty folder; None: no folder yet), or a
    ValueError when writing there could overwrite or remove anything else."""
    if out.is_symlink():
        raise ValueError(f"report folder {out} is a symbolic link; give a real folder")
    if out.resolve() in (run.resolve(), *run.resolve().parents):
        raise ValueError(f"report folder {out} is the run folder {run} or holds it; give a folder of its own "
                         f"(the default is {run / 'report'})")
    if not out.exists():
        return None
    if not out.is_dir():
        raise ValueError(f"report folder {out} is a file, not a folder")
    if not any(out.iterdir()):
        return set()
    owned, made_from = _manifest(out)
    if made_from is not None and out.resolve() != (run / "report").resolve() and made_from != str(run.resolve()):
        raise ValueError(f"report folder {out} holds the report of another run ({made_from}); give another --out, "
                         "or remove it first")
    folders = {parent.as_posix() for rel in owned for parent in Path(rel).parents if parent != Path(".")}
    foreign = [rel for rel in _entries(out) if rel not in owned]
    foreign += [f"{rel}/ (an empty folder)" for rel in _empty_folders(out) if rel not in folders]
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise ValueError(f"report folder {out} holds {foreign[0]!r}{more}, which no report wrote; give a new or "
                         "empty folder, or move them away")
    return owned


def _manifest(out: Path) -> tuple[set[str], str | None]:
    path = out / MANIFEST
    refuse = ValueError(f"{out} exists and is not a conceptlens report (no valid {MANIFEST}); give a new or "
                        f"empty folder, or remove {out} yourself")
    if path.is_symlink() or not path.is_file():
        raise refuse
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise refuse from None
    files = data.get("files") if isinstance(data, dict) and data.get("format") == FORMAT else None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise refuse
    run = data.get("run")  # the run folder it was made from (a report written before it was recorded: None)
    return {*files, MANIFEST}, run if isinstance(run, str) else None


def _entries(folder: Path) -> list[str]:
    """Every regular file under `folder` as a relative POSIX path; a symlink or special file is
    listed under its own name too, so that it never counts as owned folder content."""
    found = []
    for top, dirs, files in os.walk(folder):  # never follows symlinked folders
        rel = Path(top).relative_to(folder)
        for name in dirs:
            if os.path.islink(os.path.join(top, name)):
                found.append(f"{(rel / name).as_posix()} (a symbolic link)")
        for name in files:
            path = os.path.join(top, name)
            ok = os.path.isfile(path) and not os.path.islink(path)
            found.append((rel / name).as_posix() + ("" if ok else " (a symbolic link or special file)"))
    return sorted(found)


def _empty_folders(folder: Path) -> list[str]:
    """Every empty folder under `folder` (not following links), as a relative POSIX path: a
    rebuild removes the folders it leaves empty, so one the report did not make is not its own."""
    return sorted(Path(top).relative_to(folder).as_posix() for top, dirs, files in os.walk(folder)
                  if not dirs and not files and Path(top) != folder)


def new_staging(out: Path) -> Path:
    """A new private folder beside `out` (mkdtemp: never an existing path, never a symlink)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))


def discard(staging: Path) -> None:
    """Remove a staging folder this process made (shutil.rmtree does not follow symlinks)."""
    shutil.rmtree(staging, ignore_errors=True)


def commit(staging: Path, out: Path, owned: set[str] | None, run: Path | None = None) -> None:
    """Write the manifest of `staging`, then put it at `out`: by one rename when `out` is new or
    empty, else by renaming the earlier report aside, this one in, and deleting the earlier
    report's own files (a crash between the renames leaves the earlier one at `.NAME.old-*`)."""
    files = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file())
    made = {} if run is None else {"run": str(run.resolve())}
    (staging / MANIFEST).write_text(json.dumps({"format": FORMAT, "version": 1, "files": files, **made}, indent=1),
                                    encoding="utf-8")
    os.chmod(staging, 0o777 & ~_umask())  # mkdtemp made it 0700; the report gets a plain mkdir's mode
    if not owned:
        os.rename(staging, out)  # onto an empty folder too (POSIX)
        return
    aside = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
    os.rename(out, aside)
    try:
        os.rename(staging, out)
    except BaseException:
        os.rename(aside, out)
        raise
    _remove_owned(aside, owned)


def _remove_owned(folder: Path, owned: set[str]) -> None:
    """Delete the files of `owned` under `folder`, then the folders left empty; nothing else."""
    for top, dirs, files in os.walk(folder, topdown=False):
        rel = Path(top).relative_to(folder)
        for name in files:
            path = os.path.join(top, name)
            if (rel / name).as_posix() in owned and not os.path.islink(path):
                os.unlink(path)
        for name in dirs:
            path = os.path.join(top, name)
            if not os.path.islink(path):
                try:
                    os.rmdir(path)
                except OSError:  # not empty: something else is in it; leave it
                    pass
    try:
        folder.rmdir()
    except OSError:
        pass
