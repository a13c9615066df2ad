"""Subprocess body for the kill tests (not collected: no test_ prefix).

    python -m tests.faults.kill_worker RUN_DIR OUT MODE K

Runs a checkpointed fit of a tiny Llama. MODE `before` SIGKILLs the process just before
its K-th `os.replace` (a temporary file is written, not yet renamed), `after` just after
it, `none` never. Writes the final extractor state and the files it renamed to OUT.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

import conceptlens
from conceptlens import ConceptSet
from conceptlens.concepts.kmeans import StreamingKMeans
from tests.conftest import CharTokenizer, tiny_model

CORPUS = [f"doc {i}: " + "abcdefghij"[i % 7:] * (1 + i % 4) for i in range(48)]
SITE = "blocks.1.resid_out"


def kill_at(mode: str, k: int) -> list[str]:
    """Patch os.replace to SIGKILL around its k-th call; returns the list of renamed targets."""
    real, done = os.replace, []

    def replace(src, dst):
        if mode == "before" and len(done) + 1 == k:
            os.kill(os.getpid(), signal.SIGKILL)
        real(src, dst)
        done.append(os.path.basename(dst))
        if mode == "after" and len(done) == k:
            os.kill(os.getpid(), signal.SIGKILL)

    os.replace = replace
    return done


def run_fit(run_dir: str) -> tuple[StreamingKMeans, object]:
    torch.manual_seed(0)
    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    km = StreamingKMeans(n_concepts=4, init_size=32, seed=1)
    report = lens.fit({SITE: km}, CORPUS, batch_size=8, max_length=24, checkpoint_dir=run_dir,
                      checkpoint_every=250, progress=False)
    return km, report


def two_sets() -> tuple[ConceptSet, ConceptSet]:
    g = torch.Generator().manual_seed(0)
    a = ConceptSet(torch.randn(3, 16, generator=g), site="blocks.0.resid_out", model="model-a",
                   stats={"norm": torch.rand(3, generator=g)})
    b = ConceptSet(torch.randn(3, 16, generator=g), site="blocks.1.resid_out", model="model-b",
                   stats={"norm": torch.rand(3, generator=g)})
    return a, b


def main() -> None:
    run_dir, out, mode, k = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    done = kill_at(mode, k)
    km, report = run_fit(run_dir)
    torch.save({"state": km.state_dict(), "tokens": report.tokens, "renames": list(done)}, out)

if __name__ == "__main__":
    main()
