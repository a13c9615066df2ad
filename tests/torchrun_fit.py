"""A fit started by torchrun (not collected: no test_ prefix); see tests/test_distributed.py.

    python -m torch.distributed.run --nproc-per-node 2 tests/torchrun_fit.py OUT_DIR [BATCH_SIZE]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import conceptlens  # noqa: E402
from conceptlens.concepts import StreamingKMeans, TopKSAE  # noqa: E402
from conceptlens.concepts.sae import Crosscoder, Transcoder  # noqa: E402
from tests.conftest import CharTokenizer, tiny_model  # noqa: E402
from tests.distributed_workers import CORPUS  # noqa: E402


def extractors() -> dict:
    """One-site extractors, a transcoder (a pair key) and a crosscoder (two sites)."""
    return {"blocks.1.resid_out": StreamingKMeans(4, init_size=48, seed=1),
            "blocks.0.mlp_out": TopKSAE(width=16, k=3, batch_size=32, warmup_tokens=32, seed=2),
            ("blocks.0.mlp.in", "blocks.0.mlp_out"): Transcoder(width=16, batch_size=32, warmup_tokens=32, seed=3),
            ("blocks.0.resid_out", "blocks.1.resid_out"): Crosscoder(width=16, k=3, batch_size=32, warmup_tokens=32,
                                                                     seed=4)}


def fit(batch_size: int, distributed: bool) -> tuple[dict, object]:
    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    fitted = extractors()
    report = lens.fit(fitted, CORPUS, batch_size=batch_size, max_length=24, progress=False, distributed=distributed)
    return fitted, report


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    fitted, report = fit(int(sys.argv[2]) if len(sys.argv) > 2 else 4, True)
    rank = int(os.environ["RANK"])
    torch.save({"tokens": report.tokens, "documents": report.documents,
                "states": {k: e.state_dict() for k, e in fitted.items()}}, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
