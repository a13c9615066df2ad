"""benchmarks/distributed.py's tiny mode runs end to end (1 gloo rank, and 2 unsharded and
sharded), so the 1/2/4-process benchmark cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is unavailable")


def test_tiny_distributed_benchmark_reports_every_run_against_its_baseline(tmp_path):
    """Each run fits the same documents (the same global token count); the table puts tokens/s
    next to 1 process and each rank's state next to the unsharded fit's, and a sharded rank on
    2 processes holds less state than an unsharded one."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "distributed.py"), "--tiny", "--json", str(out)],
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {(r["world"], r["sharded"]) for r in rows.values()} == {(1, False), (2, False), (2, True)}
    assert len({r["tokens"] for r in rows.values()}) == 1
    by = {(r["world"], r["sharded"]): r for r in rows.values()}
    assert max(by[2, True]["state_mib_per_rank"]) < min(by[2, False]["state_mib_per_rank"])
    assert by[2, True]["collectives_per_rank"] > 0 and by[1, False]["allreduce_ms_per_step"] >= 0
    table = done.stdout.splitlines()
    assert table[0].startswith("# ") and "load average" in table[0]
    assert sum(line.startswith("| 2 | yes |") for line in table) == 1
    assert "x 1 process" in done.stdout and "x unsharded" in done.stdout
