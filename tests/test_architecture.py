"""The architecture's rules, checked by real tools: import-linter's contracts in pyproject.toml
(the layer order, concepts/ free of hooks and transformers, no import cycles) and mypy's
configuration there. Both run as `make test` runs them; a failure shows the tool's report."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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

