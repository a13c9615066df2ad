"""CLI misuse: exit code 2 and one line, decided before any model loads."""

from __future__ import annotations

import pytest

from conceptlens import ConceptSet, models
from conceptlens.cli import COMMANDS, main


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load", load)


@pytest.fixture
def files(tmp_path):
    import torch

    (tmp_path / "empty.txt").write_text("\n  \n\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "a_file").write_text("not a folder")
    ConceptSet(torch.ones(2, 32), site="blocks.0.resid_out").save(tmp_path / "set")
    return tmp_path


STEER = ["steer", "--model", "smollm2-135m"]
CASES = {
    "steer-missing-concepts": (STEER + ["--concepts", "{t}/nope", "--prompt", "hi"], "--concepts", "does not exist"),
    "steer-concepts-a-file": (STEER + ["--concepts", "{t}/a_file", "--prompt", "hi"], "is a file"),
    "steer-empty-prompt": (STEER + ["--concepts", "{t}/set", "--prompt", ""], "--prompt", "empty"),
    "steer-alpha-nan": (STEER + ["--concepts", "{t}/set", "--prompt", "hi", "--alpha", "nan"], "--alpha",
                        "'nan' is not a finite number"),
    "steer-alpha-inf": (STEER + ["--concepts", "{t}/set", "--prompt", "hi", "--alpha=-inf"], "--alpha", "'-inf'"),
    "steer-empty-word": (STEER + ["--direction-word", "", "--prompt", "hi"], "--direction-word", "empty"),
    "steer-zero-tokens": (STEER + ["--concepts", "{t}/set", "--prompt", "hi", "--max-new-tokens", "0"],
                          "--max-new-tokens", "0 is not a positive integer"),
    "steer-missing-option": (STEER + ["--prompt", "hi"], "required"),
    "demo-empty-prompt": (["demo", "--prompt", ""], "--prompt", "empty"),
    "demo-zero-tokens": (["demo", "--max-tokens", "0"], "--max-tokens", "0 is not a positive integer"),
    "gauge-empty-txt": (["gauge", "--data", "{t}/empty.txt"], "--data", "empty.txt' is empty"),
    "gauge-empty-jsonl": (["gauge", "--data", "{t}/empty.jsonl"], "--data", "empty.jsonl' is empty"),
    "gauge-missing-data": (["gauge", "--data", "{t}/nope.txt"], "--data", "neither a file nor a bundled set",
                          "bbc-news"),
    "gauge-bad-split": (["gauge", "--data", "bbc-news:dev"], "unknown split 'dev'"),
    "demo-out-a-file": (["demo", "--out", "{t}/a_file"], "--out", "is a file"),
    "demo-out-under-a-file": (["demo", "--out", "{t}/a_file/run"], "--out", "cannot be created"),
    "demo-out-not-writable": (["demo", "--out", "/proc/conceptlens-run"], "--out", "not writable"),
    "eval-missing-run": (["eval", "{t}/nope", "--task", "bbc-news"], "run_dir", "does not exist"),
    "eval-bad-count": (["eval", "{t}/set", "--task", "bbc-news", "--ce-docs", "-1"], "--ce-docs"),
    "eval-bad-reading": (["eval", "{t}/set", "--probe-read", "code,linear"], "--probe-read", "unknown reading linear",
                         "activation, code"),
    "sweep-empty-word": (["sweep", "--direction-word", ""], "--direction-word", "empty"),
    "sweep-empty-target": (["sweep", "--concepts", "{t}/set", "--target-word", ""], "--target-word", "empty"),
    "sweep-empty-prompt": (["sweep", "--concepts", "{t}/set", "--prompts", "a", ""], "--prompts", "empty"),
    "sweep-alpha-nan": (["sweep", "--concepts", "{t}/set", "--alphas", "0", "nan"], "--alphas", "'nan'"),
    "sweep-plot-a-folder": (["sweep", "--concepts", "{t}/set", "--plot", "{t}/set"], "--plot", "is a folder"),
    "sweep-plot-unwritable": (["sweep", "--concepts", "{t}/set", "--plot", "/proc/x/p.png"], "--plot", "cannot be"),
    "ablate-missing-concepts": (["ablate", "--concepts", "{t}/nope", "--concept", "1"], "--concepts", "not exist"),
    "ablate-empty-data": (["ablate", "--concepts", "{t}/set", "--concept", "1", "--data", "{t}/empty.txt"],
                          "--data", "is empty"),
    "ablate-zero-controls": (["ablate", "--concepts", "{t}/set", "--concept", "1", "--n-controls", "0"],
                             "--n-controls"),
    "report-missing-run": (["report", "{t}/nope"], "no run folder"),
    "report-out-a-file": (["report", "{t}", "--out", "{t}/a_file"], "--out", "is a file"),
    "unknown-option": (STEER + ["--concepts", "{t}/set", "--prompt", "hi", "--modle", "x"], "unrecognized arguments"),
}


@pytest.mark.parametrize("case", CASES)
def test_cli_misuse_is_one_line_with_exit_code_2(files, capsys, case):
    argv, *names = CASES[case]
    code = main([a.replace("{t}", str(files)) for a in argv])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"conceptlens {argv[0]}: error:") or err.startswith("conceptlens: error:"), err
    for name in names:
        assert name in err, err


def test_a_user_error_raised_while_running_is_one_line(files, capsys, monkeypatch):
    from conceptlens.commands import steer

    def run(args):
        raise ValueError("first line\nsecond line")

    monkeypatch.setattr(steer, "run", run)
    assert main(STEER + ["--concepts", str(files / "set"), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == "conceptlens steer: error: first line second line\n"


@pytest.mark.parametrize("command", [[], *([name] for name in COMMANDS)])
def test_help_prints_every_option_and_exits_0(command, capsys):
    """`conceptlens --help` lists every command (its one-line help went through argparse's %-formatting:
    "95% intervals" raised a TypeError there), and each command's --help prints its options."""
    assert main([*command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: conceptlens")
    for name in ([] if command else COMMANDS):
        assert name in out
    if command == ["eval"]:
        assert "95% intervals" in out and "--random-draws" in out
