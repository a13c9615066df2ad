"""Ctrl-C (or a scheduler's SIGTERM) that waits for the current batch, so a fit can checkpoint what it has done.

    with deferred() as ctrl_c:
        for batch in batches:
            step(batch)
            if ctrl_c.pressed:
                break          # then save and raise KeyboardInterrupt

A first Ctrl-C (SIGINT) only sets `pressed`; a second one raises KeyboardInterrupt at once,
as Python does by default. SIGTERM (what a job scheduler or `timeout` sends before it kills)
does the same where nobody else handles it: the batch finishes and the checkpoint is written
within the grace period a scheduler gives. Outside the main thread (where no signal handler can
be set) the scope changes nothing.
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator


class CtrlC:
    """Whether SIGINT (or SIGTERM) arrived inside a `deferred()` scope."""

    def __init__(self) -> None:
        self.pressed = False

    def _handle(self, signum: int, frame: Any) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"\n{what}: finishing this batch and writing a checkpoint ({what} again to stop at once)",
              file=sys.stderr, flush=True)


@contextmanager
def deferred() -> Iterator[CtrlC]:
    """A scope in which SIGINT is recorded rather than raised (see the module docstring)."""
    ctrl_c = CtrlC()
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield ctrl_c  # not ours to change: another handler (or a thread) keeps its behaviour
        return
    previous = signal.signal(signal.SIGINT, ctrl_c._handle)
    term = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # another handler's SIGTERM stays theirs
    if term:
        signal.signal(signal.SIGTERM, ctrl_c._handle)
    try:
        yield ctrl_c
    finally:
        signal.signal(signal.SIGINT, previous)
        if term:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
