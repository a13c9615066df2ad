"""Two processes and one run folder: a second writer fails at once naming the first, a
SIGKILL frees the folder, and Ctrl-C (SIGINT) checkpoints a fit or description pass and says
the token count its rerun resumes from."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conceptlens.checkpoint import read_checkpoint
from conceptlens.cli import main
from conceptlens.runlock import LOCK_FILE, RunFolderBusy, lock
from tests.test_cli_fit import base, files  # noqa: F401 - the fixture: a tiny Llama folder and docs.txt

ROOT = Path(__file__).resolve().parents[2]
NO_PERIODIC = ("--no-describe", "--checkpoint-every", "1000000")  # only Ctrl-C writes a checkpoint


def _paused(tmp_path: Path, k: int, argv: list[str]) -> tuple[subprocess.Popen, Path]:
    """`conceptlens ARGV` in a subprocess, paused after the K-th step of its fit loop."""
    go = tmp_path / "go"
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "tests.faults.pause_worker", str(go), str(k), *argv], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # the command's own output, then the worker's mark
        if line.strip() == "paused":
            return proc, go
    proc.kill()
    pytest.fail(f"the worker ended without pausing: {proc.communicate()[1][-2000:]}")


def _same_concepts(a: Path, b: Path) -> None:
    for name in ("km", "topk"):
        x, y = (load_file(run / "concepts" / name / "concepts.safetensors") for run in (a, b))
        assert x.keys() == y.keys() and all((x[k] == y[k]).all() for k in x), name


def test_a_second_writer_fails_at_once_naming_the_first_and_a_kill_frees_the_folder(files, tmp_path, capsys):  # noqa: F811
    run = tmp_path / "run"
    proc, _ = _paused(tmp_path, 2, base(files, run, "--no-describe"))
    try:
        holder = json.loads((run / LOCK_FILE).read_text())
        assert holder["pid"] == proc.pid and holder["what"] == "fit" and "pause_worker" in holder["command"]
        for argv in (["report", str(run)], ["describe", str(run)], base(files, run, "--no-describe")):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err.strip()
            assert f"is being written by pid {proc.pid}" in err and "(fit:" in err and holder["started"] in err
            assert "\n" not in err
        with pytest.raises(RunFolderBusy, match=f"pid {proc.pid}"):  # the library's fit too
            from tests.faults.kill_worker import run_fit
            run_fit(str(run))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    with lock(run, "test"):  # the OS released it
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not (run / LOCK_FILE).exists()  # released: the holder unlinked it
    assert main(base(files, run, "--no-describe")) == 0


def test_nested_scopes_of_one_process_share_its_lock_and_a_created_folder_goes_away(tmp_path):
    folder = tmp_path / "new" / "run"
    with lock(folder, "fit"):
        with lock(folder, "describe"):  # e.g. the CLI's fit holding the run while lens.fit writes it
            assert json.loads((folder / LOCK_FILE).read_text())["what"] == "fit"
    assert not (tmp_path / "new").exists()  # created for the lock and nothing else written: removed again
    with lock(folder, "fit"):
        (folder / "run.toml").write_text("")
    assert (folder / "run.toml").is_file() and not (folder / LOCK_FILE).exists()


def test_a_released_lock_leaves_no_file_and_a_stale_open_of_it_takes_the_new_one(tmp_path):
    """A refused or finished command leaves no lock file in a folder it was pointed at. A process that
    opened the lock file just before its holder released (and unlinked) it locks a file no other
    process can see: it must notice and lock the path's current file, so two writers never both hold."""
    import fcntl

    from conceptlens import runlock

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with lock(folder, "report"):
        assert (folder / LOCK_FILE).is_file()
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    opened = []
    real_open = runlock._open

    def late_open(path):  # the first open happens while another process holds the file, which it then releases
        fd = real_open(path)
        if not opened:
            other = os.open(path, os.O_RDWR)
            fcntl.flock(other, fcntl.LOCK_EX)
            os.unlink(path)  # as `_release` does, still locked
            fcntl.flock(other, fcntl.LOCK_UN)
            os.close(other)
        opened.append(os.fstat(fd).st_ino)
        return fd

    runlock._open = late_open
    try:
        with lock(folder, "fit"):
            held = os.stat(folder / LOCK_FILE).st_ino
            assert len(opened) == 2 and opened[-1] == held  # it retried on the path's new file
            assert json.loads((folder / LOCK_FILE).read_text())["what"] == "fit"
    finally:
        runlock._open = real_open
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


def _interrupt(proc: subprocess.Popen, go: Path, signum: int = signal.SIGINT) -> tuple[int, str]:
    proc.send_signal(signum)  # Ctrl-C (or a scheduler's SIGTERM) in the middle of a batch
    go.touch()
    _, err = proc.communicate(timeout=300)
    line = err.strip().splitlines()[-1]
    found = re.fullmatch(r"interrupted: stopped after ([\d,]+) tokens, saved in (.+); run it again to resume "
                         r"from ([\d,]+) tokens", line)
    assert proc.returncode == 130 and found, err[-2000:]
    assert found.group(1) == found.group(3)
    tokens = int(found.group(1).replace(",", ""))
    assert read_checkpoint(Path(found.group(2)))["progress"]["tokens"] == tokens
    return tokens, found.group(2)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_during_a_fit_checkpoints_and_the_rerun_resumes_from_the_count_it_printed(
        files, tmp_path, signum):  # noqa: F811
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main(base(files, whole, *NO_PERIODIC)) == 0
    proc, go = _paused(tmp_path, 3, base(files, cut, *NO_PERIODIC))
    tokens, path = _interrupt(proc, go, signum)
    assert Path(path) == cut / "checkpoint.pt" and not (cut / "concepts").exists()
    assert main(base(files, cut, *NO_PERIODIC)) == 0
    assert json.loads((cut / "fit_report.json").read_text())["resumed_from"] == tokens
    _same_concepts(whole, cut)


def test_ctrl_c_during_a_description_pass_checkpoints_it(files, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    assert main(base(files, run, *NO_PERIODIC)) == 0
    whole = tmp_path / "whole"
    shutil.copytree(run, whole)
    assert main(["describe", str(whole), "--concepts", "km"]) == 0
    proc, go = _paused(tmp_path, 2, ["describe", str(run), "--concepts", "km"])
    tokens, path = _interrupt(proc, go)
    assert Path(path) == run / "describe" / "checkpoint.pt" and tokens > 0
    assert main(["describe", str(run), "--concepts", "km"]) == 0
    assert not Path(path).exists()
    for name in ("contexts.jsonl", "description.json"):
        assert (run / "describe" / "km" / name).read_text() == (whole / "describe" / "km" / name).read_text(), name


def test_the_library_writers_take_the_lock(tmp_path):
    """lens.fit with a checkpoint_dir, lens.describe with an out and write_report each fail at
    once on a folder another process holds (here a bare `lock` in a subprocess)."""
    import torch

    import conceptlens
    from conceptlens import ConceptSet
    from conceptlens.concepts.kmeans import StreamingKMeans
    from conceptlens.report import write_report
    from tests.conftest import CharTokenizer, tiny_model

    held = tmp_path / "held"
    code = ("import sys, time; from conceptlens.runlock import lock\n"
            "with lock(sys.argv[1], 'test'):\n    print('held', flush=True)\n    time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(held)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
        cs = ConceptSet(torch.randn(3, 32), site="blocks.1.resid_out")
        busy = f"is being written by pid {proc.pid}"
        with pytest.raises(RunFolderBusy, match=busy):
            lens.fit({"blocks.1.resid_out": StreamingKMeans(2)}, ["a b c"],
                     checkpoint_dir=str(held), progress=False)
        with pytest.raises(RunFolderBusy, match=busy):
            lens.describe({"a": cs}, ["a b c"], out=str(held), progress=False)
        with pytest.raises(RunFolderBusy, match=busy):
            write_report(held)
        assert sorted(p.name for p in held.iterdir()) == [LOCK_FILE]  # none of them wrote anything
        from conceptlens import models
        from conceptlens.cli import main

        cs.model = "smollm2-135m"
        cs.save(held / "concepts" / "a")
        loads = models.load
        models.load = lambda *a, **k: pytest.fail("eval loaded the model before finding the folder busy")
        try:  # eval, which saves into the folder, finds it busy before it loads the model or computes a part
            assert main(["eval", str(held), "--suite", "probing", "--task", "bbc-news", "--no-progress"]) == 2
        finally:
            models.load = loads
    finally:
        proc.kill()
        proc.wait()
