"""The architecture's rules, checked by real tools: import-linter's contracts in pyproject.toml
(the layer order, concepts/ free of hooks and transformers, no import cycles) and mypy over the
whole package as configured there. Both run as `make test` runs them; a failure shows the
tool's report.

mypy's run must be clean: any error fails the test, listed without line numbers
(`python -m mypy | python tests/test_architecture.py` prints that list)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_ERROR = re.compile(r"^(?P<path>[^:]+):\d+: error: (?P<message>.*?)  \[(?P<code>[a-z-]+)\]$")


def _run(*argv: str, config: Path | None = None) -> subprocess.CompletedProcess:
    # this checkout's conceptlens, not an installed copy: the tools import the package from the cwd
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([*argv, *(["--config", str(config)] if config else [])], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


def _lint_imports(config: Path | None = None) -> subprocess.CompletedProcess:
    return _run(str(Path(sys.executable).with_name("lint-imports")), "--no-cache", config=config)


def test_import_contracts_hold():
    done = _lint_imports()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout and " kept, " in done.stdout


def test_a_reversed_layer_is_reported(tmp_path):
    """The linter sees this package's imports: hooks read sites, so sites above hooks breaks."""
    config = tmp_path / "reversed.toml"
    config.write_text('[tool.importlinter]\nroot_package = "conceptlens"\n\n[[tool.importlinter.contracts]]\n'
                      'name = "reversed"\ntype = "layers"\nlayers = ["conceptlens.sites", "conceptlens.hooks"]\n')
    done = _lint_imports(config)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "conceptlens.sites is not allowed to import conceptlens.hooks" not in done.stdout
    assert "conceptlens.hooks is not allowed to import conceptlens.sites" in done.stdout


def mypy_errors(report: str) -> Counter[str]:
    """mypy's error lines as `path: [code] message`, line numbers left out (they move with edits)."""
    found: Counter[str] = Counter()
    for line in report.splitlines():
        if (m := _ERROR.match(line)) is not None:
            message = re.sub(r"line \d+", "line N", m["message"])
            found[f"{m['path']}: [{m['code']}] {message}"] += 1
    return found


def test_mypy_reports_no_error():
    done = _run(sys.executable, "-m", "mypy")
    assert done.returncode in (0, 1) and ("Success: no issues found" in done.stdout or
                                          "Found " in done.stdout), done.stdout + done.stderr  # not a crash
    errors = mypy_errors(done.stdout)
    assert not errors and done.returncode == 0, "mypy errors:\n" + "\n".join(sorted(errors.elements()))


def test_the_error_list_leaves_out_line_numbers_and_counts_repeats():
    report = ("a.py:3: error: Bad thing on line 12  [misc]\na.py:9: error: Bad thing on line 40  [misc]\n"
              "a.py:9: note: see here\nFound 2 errors in 1 file (checked 1 source file)\n")
    assert mypy_errors(report) == Counter({"a.py: [misc] Bad thing on line N": 2})


if __name__ == "__main__":  # mypy's report on stdin -> the known-error list on stdout
    print("\n".join(sorted(mypy_errors(sys.stdin.read()).elements())))
