"""benchmarks/gpu.py cannot rot: its dry run (tiny sizes, CPU) runs here with only torch and
transformers importable among the heavy dependencies, as on a bare GPU machine."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Packages a bare GPU machine with only torch and transformers would not have.
BLOCKED = ("scipy", "sklearn", "networkx", "matplotlib", "gguf", "accelerate", "nnsight", "sae_lens", "selenium")

RUN = f"""
import sys
for name in {BLOCKED!r}:
    sys.modules[name] = None  # import fails, importlib.util.find_spec says "not installed"
sys.argv = ["gpu.py", "--dry-run", "--rounds", "1"]
sys.path.insert(0, {str(ROOT / "benchmarks")!r})
import gpu
sys.exit(gpu.main(sys.argv[1:]))
"""


def test_gpu_benchmark_dry_run_prints_every_row():
    done = subprocess.run([sys.executable, "-c", RUN], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    table = {(r[0].strip("| "), r[1], r[2].split(" at ")[0]) for r in rows[1:]}
    for model in ("smollm2-135m", "llama-1b", "gemma-2b"):
        assert (model, "capture", "bare forward") in table
        assert (model, "steer", "lens.steer Add (all positions)") in table
        assert (model, "fit", "capture-only (no-op extractor)") in table
        assert (model, "fit", "TopKSAE width 16x, k=4") in table
    # every ratio is a finite positive number next to its named baseline
    for r in rows[1:]:
        ratio = float(r[4].split("x ")[0])
        assert ratio > 0 and r[4].split("x ", 1)[1].startswith("of ")
