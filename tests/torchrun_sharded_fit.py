"""A fit of sharded dictionaries started by torchrun (not collected: no test_ prefix); see tests/test_sharded.py.

    python -m torch.distributed.run --nproc-per-node 2 tests/torchrun_sharded_fit.py OUT_DIR [MAX_TOKENS]

Per-rank batch 4 over tests.distributed_workers.CORPUS, checkpoints in OUT_DIR/run (resumed
when there); each rank saves the fitted concept sets and its shard sizes to OUT_DIR/rank{r}.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import conceptlens  # noqa: E402
from conceptlens.concepts.sae.sharded import ShardedTopKSAE  # noqa: E402
from conceptlens.concepts.sharded import ShardedKMeans  # noqa: E402
from conceptlens.concepts import ShardedVQ, VQCodebook  # noqa: E402
from tests.conftest import CharTokenizer, tiny_model  # noqa: E402
from tests.distributed_workers import CORPUS  # noqa: E402
from tests.torchrun_fit import extractors  # noqa: E402

VQ = dict(init_size=48, top_k=2, batch_size=16, reseed_after=5, seed=3)


def plain_extractors() -> dict:
    """tests/torchrun_fit.py's one-site extractors and a VQ codebook of 6 codes."""
    return {**{key: e for key, e in extractors().items() if isinstance(key, str)},
            "blocks.0.resid_out": VQCodebook(6, **VQ)}


def sharded_extractors() -> dict:
    """`plain_extractors()`, sharded."""
    plain = extractors()
    km, sae = plain["blocks.1.resid_out"], plain["blocks.0.mlp_out"]
    return {"blocks.1.resid_out": ShardedKMeans.from_config(km.config_dict()),
            "blocks.0.mlp_out": ShardedTopKSAE.from_config(sae.config.to_json(), seed=sae.seed),
            "blocks.0.resid_out": ShardedVQ(6, **VQ)}


def fit_alone(batch_size: int):
    """The unsharded extractors fitted by one process: its report."""
    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    return lens.fit(plain_extractors(), CORPUS, batch_size=batch_size, max_length=24, progress=False)


def concepts(report) -> dict:
    return {name: {"directions": cs.directions, "encoder": cs.encoder} for name, cs in report.concepts.items()}


def main() -> None:
    out = Path(sys.argv[1])
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else None
    torch.set_num_threads(1)
    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    fitted = sharded_extractors()
    report = lens.fit(fitted, CORPUS, batch_size=4, max_length=24, progress=False, distributed=True,
                      max_tokens=max_tokens, checkpoint_dir=str(out / "run"), resume=True)
    rank = int(os.environ["RANK"])
    torch.save({"tokens": report.tokens, "resumed_from": report.resumed_from, "concepts": concepts(report),
                "rows": (fitted["blocks.1.resid_out"]._centres.shape[0],
                         fitted["blocks.0.mlp_out"].params["W_dec"].shape[0],
                         fitted["blocks.0.resid_out"].fitted.codes.shape[0])}, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
