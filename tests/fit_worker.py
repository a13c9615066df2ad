"""Subprocess body for the kill-and-resume test (not collected: no test_ prefix).

    python -m tests.fit_worker RUN_DIR OUT_FILE [KILL_AFTER_UPDATES]

Fits a tiny random Llama over a fixed synthetic corpus with checkpoints; if
KILL_AFTER_UPDATES is given, the process SIGKILLs itself inside the update that many calls
in (mid-fit, after some checkpoints). Writes the final extractor states to OUT_FILE.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

import conceptlens
from conceptlens.concepts.kmeans import StreamingKMeans
from tests.conftest import CharTokenizer, tiny_model

CORPUS = [f"document {i}: " + "abcdefghij"[i % 7:] * (1 + i % 5) for i in range(120)]


class KillSwitch:
    """Wraps an extractor; SIGKILLs the process on the n-th update (a crash, no cleanup)."""

    def __init__(self, inner, after: int | None) -> None:
        self.inner, self.after, self.calls = inner, after, 0

    def update(self, x):
        self.calls += 1
        if self.after is not None and self.calls == self.after:
            os.kill(os.getpid(), signal.SIGKILL)
        self.inner.update(x)

    def flush(self):
        self.inner.flush()

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)

    def concept_set(self):
        return self.inner.concept_set()


def main() -> None:
    run_dir, out = sys.argv[1], sys.argv[2]
    kill_after = int(sys.argv[3]) if len(sys.argv) > 3 else None
    torch.manual_seed(0)
    model = tiny_model("llama")
    lens = conceptlens.attach(model, CharTokenizer())
    extractors = {"blocks.1.resid_out": KillSwitch(StreamingKMeans(n_concepts=6, init_size=64), kill_after),
                  "blocks.0.mlp_out": StreamingKMeans(n_concepts=4, spherical=True, init_size=32, seed=3)}
    report = lens.fit(extractors, CORPUS, batch_size=8, max_length=24, checkpoint_dir=run_dir,
                      checkpoint_every=400, progress=False)
    torch.save({"states": {k: e.state_dict() for k, e in extractors.items()}, "tokens": report.tokens,
                "resumed_from": report.resumed_from}, out)


if __name__ == "__main__":
    main()
