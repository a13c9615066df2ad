"""Crashes at every write point: a killed fit or save leaves no lasting debris and no mixed set."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from conceptlens import ConceptSet
from tests.conftest import assert_same_state
from tests.faults.kill_worker import run_fit, two_sets

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = "checkpoint.pt"
N_RENAMES = 6  # a fit of the worker: checkpoints at 250, 500 and 750 tokens, the final one, the set's two files


def _worker(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "tests.faults.kill_worker", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def _leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*.tmp"))


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted fit, in a subprocess, with the list of files it renamed into place."""
    root = tmp_path_factory.mktemp("whole")
    done = _worker(root / "run", root / "out.pt", "none", 0)
    assert done.returncode == 0, done.stderr
    return torch.load(root / "out.pt"), ConceptSet.load(root / "run" / "concepts" / "blocks.1.resid_out")


def test_the_worker_renames_at_every_write_point(whole):
    out, _ = whole
    assert out["renames"] == [CHECKPOINT] * 4 + ["concepts.safetensors", "config.json"]
    assert len(out["renames"]) == N_RENAMES


@pytest.mark.parametrize("mode, k", [*(("before", k) for k in range(1, N_RENAMES + 1)), ("after", 4), ("after", 5)])
def test_killed_fit_leaves_no_debris_and_resumes_bit_identical(whole, tmp_path, mode, k):
    run = tmp_path / "run"
    killed = _worker(run, tmp_path / "never.pt", mode, k)
    assert killed.returncode == -9, killed.stderr
    if mode == "before":  # the kill hit between writing a temporary file and renaming it
        assert _leftovers(run), "the kill point left no temporary file: the case tests nothing"
    km, report = run_fit(str(run))  # the next run, in this process
    assert _leftovers(run) == []
    out, concepts = whole
    assert report.tokens == out["tokens"]
    assert_same_state(out["state"], km.state_dict())
    again = ConceptSet.load(run / "concepts" / "blocks.1.resid_out")
    assert torch.equal(again.directions, concepts.directions)


class Crash(BaseException):
    """Stands for a kill: nothing after it in the save runs."""


@pytest.mark.parametrize("mode, k", [("before", 1), ("after", 1), ("before", 2), ("after", 2)])
def test_a_save_killed_over_an_old_set_leaves_the_old_set_or_the_new_one(tmp_path, monkeypatch, mode, k):
    folder = tmp_path / "set"
    old, new = two_sets()
    old.save(folder)
    real, done = os.replace, []

    def replace(src, dst):  # crash just before or just after the k-th rename of the save
        if mode == "before" and len(done) + 1 == k:
            raise Crash
        real(src, dst)
        done.append(dst)
        if mode == "after" and len(done) == k:
            raise Crash

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Crash):
        new.save(folder)
    monkeypatch.setattr(os, "replace", real)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a config.json left from the old save is reported, not used
        loaded = ConceptSet.load(folder)
    matches = [s for s in two_sets() if torch.equal(s.directions, loaded.directions) and s.site == loaded.site
               and s.model == loaded.model and torch.equal(s.stats["norm"], loaded.stats["norm"])]
    assert len(matches) == 1, f"a mixed set: directions of one save, site {loaded.site!r} / model {loaded.model!r}"
    ConceptSet(torch.ones(2, 4), site="blocks.0.resid_out").save(folder)  # the next save cleans up
    assert _leftovers(folder) == []


def test_saved_files_get_the_umask_mode(tmp_path, monkeypatch):
    from tests.faults.test_integrity import checkpoint_of

    old = os.umask(0o022)
    try:
        ConceptSet(torch.ones(2, 4), site="blocks.0.resid_out").save(tmp_path / "set")
        checkpoint_of(tmp_path / "run")
    finally:
        os.umask(old)
    for path in [tmp_path / "set" / "concepts.safetensors", tmp_path / "set" / "config.json",
                 tmp_path / "run" / CHECKPOINT]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def test_the_folder_is_fsynced_after_the_rename(tmp_path, monkeypatch):
    real, synced = os.fsync, []

    def fsync(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    ConceptSet(torch.ones(2, 4), site="blocks.0.resid_out").save(tmp_path / "set")
    assert synced.count(True) >= 2 and synced.count(False) >= 2  # each file, then its folder
