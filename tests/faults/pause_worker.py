"""Subprocess body for the Ctrl-C and run-lock tests (not collected: no test_ prefix).

    python -m tests.faults.pause_worker GO_FILE K conceptlens-arguments...

Runs `conceptlens` with those arguments; after the fit loop's K-th step (of a fit or of a
description pass) it prints "paused" and waits until GO_FILE exists, so that the test can
signal it or write to its run folder at a known point.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import conceptlens.fit
from conceptlens.cli import main


def pause_at(k: int, go: Path) -> None:
    step, calls = conceptlens.fit._step, []

    def pausing(*args, **kwargs):
        n_tokens = step(*args, **kwargs)
        calls.append(n_tokens)
        if len(calls) == k:
            print("paused", flush=True)
            while not go.exists():
                time.sleep(0.05)
        return n_tokens

    conceptlens.fit._step = pausing


if __name__ == "__main__":
    # as in a terminal: a test suite started as a background job inherits SIGINT ignored, and so would this
    signal.signal(signal.SIGINT, signal.default_int_handler)
    pause_at(int(sys.argv[2]), Path(sys.argv[1]))
    sys.exit(main(sys.argv[3:]))
