"""Every script in examples/ runs (on a tiny random Llama saved to a folder, small budgets)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

from tests.tiny_folder import save_tiny_llama

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def run_example(name: str, *args: str) -> None:
    argv = sys.argv
    sys.argv = [name, *args]
    try:
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    finally:
        sys.argv = argv


def test_every_example_is_tested():
    tested = {"sites.py", "steer.py", "ablate.py", "gauge_audit.py", "fit_and_report.py",
              "nnsight_trace.py"}  # the last in tests/test_nnsight.py
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_sites(tiny, capsys):
    run_example("sites.py", "--model", tiny, "--filter", "blocks.1")
    out = capsys.readouterr().out
    assert "blocks.1.resid_out" in out and "blocks.1.attn.q" in out and "blocks.0.mlp_out" not in out


def test_steer(tiny, capsys):
    run_example("steer.py", "--model", tiny, "--max-tokens", "3000", "--alpha", "4")
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("alpha 0.00") and lines[1].startswith("alpha 4.00")
    assert lines[0].split(": ", 1)[1] != lines[1].split(": ", 1)[1]  # the concept changed the continuation


def test_ablate(tiny, capsys):
    run_example("ablate.py", "--model", tiny, "--max-tokens", "3000", "--texts", "20")
    out = capsys.readouterr().out
    assert "controls" in out and "z =" in out


def test_gauge_audit(tiny, capsys):
    run_example("gauge_audit.py", "--model", tiny)
    out = capsys.readouterr().out
    assert "mean key norm (ours)" in out and "moved" in out
    assert "key_distance" not in out.split("not gauge invariant:")[1]


def test_fit_and_report(tiny, tmp_path, capsys):
    run_example("fit_and_report.py", "--model", tiny, "--max-tokens", "3000", "--out", str(tmp_path / "run"))
    out = capsys.readouterr().out
    assert "open file://" in out
    assert (tmp_path / "run" / "report" / "concepts" / "topk" / "0.html").is_file()
    assert (tmp_path / "run" / "report" / "concepts" / "kmeans" / "31.html").is_file()
