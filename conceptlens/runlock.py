"""One writer per run folder: an OS file lock that the OS releases when its process dies.

    with lock("runs/x", "fit"):
        ...   # another process's lock("runs/x", ...) raises RunFolderBusy at once, naming this one

    @locks_first_argument("report")
    def write_report(run, out=None): ...

`fit` (with a checkpoint_dir), the description pass and `write_report` hold it while they
write. The lock is `fcntl.flock` on `FOLDER/.conceptlens.lock`, which records the holder's
pid, command line and start time; a holder unlinks the file as it releases it (so a command that
was refused, or finished, leaves no file behind), and a process that locked the file a holder
unlinked meanwhile sees that the path no longer names it and locks the path's new file. A SIGKILLed
holder leaves the file but not the lock. It is
per process: a scope nested in one that already holds the folder (the CLI's `fit` holding
the run while `lens.fit` writes it) goes through. A folder this process may not write
(read-only, or a file) is not locked: the writer itself then fails and says why.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

LOCK_FILE = ".conceptlens.lock"
F = TypeVar("F", bound=Callable[..., Any])


class RunFolderBusy(BlockingIOError):
    """Another process is writing this run folder (an OSError: the CLI reports it in one line)."""


@contextmanager
def lock(folder: str | os.PathLike, what: str, *, create: bool = True) -> Iterator[None]:
    """Hold `folder`'s lock for the scope. `what`: the writer's kind (fit, describe, report),
    recorded for the message another writer gets. A missing folder is created (and removed
    again if it ends up empty), or with `create=False` (a writer that
    needs the folder to exist) left missing and unlocked, for the writer to report."""
    folder = Path(folder)
    created = [p for p in (folder, *folder.parents) if not p.exists()]  # what the lock makes, deepest first
    path = folder / LOCK_FILE
    while True:
        fd = _open(path) if create or not created else None
        if fd is None:  # a folder this process cannot write is one it does not write (its writer says why)
            yield
            return
        try:
            nested = _acquire(fd, folder)
        except BaseException:
            os.close(fd)
            raise
        if nested or _still_at(fd, path):
            break
        os.close(fd)  # a holder that released meanwhile unlinked the file this one locked: lock the path's file
    try:
        if not nested:
            _record(fd, what)
        try:
            yield
        finally:
            if not nested:
                _release(fd, path, created)
    finally:
        os.close(fd)


def locks_first_argument(what: str) -> Callable[[F], F]:
    """Decorate a function whose first argument is an existing run folder it writes:
    `lock(run, what, create=False)` is held for the call."""
    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def locked(run: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
            with lock(run, what, create=False):
                return fn(run, *args, **kwargs)
        return locked  # type: ignore[return-value]
    return decorate


def _open(path: Path) -> int | None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise OSError(f"{path} is a symbolic link; a run folder's lock file must be a plain file") from None
        return None


def _acquire(fd: int, folder: Path) -> bool:
    """Take the lock; True when this process holds it already (a nested scope)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        holder = _holder(fd)
    if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        return True
    who = (f"pid {holder.get('pid')} on {holder.get('host')} ({holder.get('what')}: {holder.get('command')!r}, "
           f"started {holder.get('started')})" if holder else "another process (just starting)")
    raise RunFolderBusy(f"run folder {str(folder)!r} is being written by {who}; wait for it to finish, stop it, "
                        "or use another folder")


def _record(fd: int, what: str) -> None:
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else "python"
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "what": what, "command": command[:300],
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)


def _holder(fd: int) -> dict:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _still_at(fd: int, path: Path) -> bool:
    """Whether the locked file is still the one at `path` (a releasing holder unlinks it)."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def _release(fd: int, path: Path, created: list[Path]) -> None:
    os.ftruncate(fd, 0)
    if _still_at(fd, path):  # while still locked: one who opened it meanwhile finds it unlinked and retries
        path.unlink()
    try:
        for made in created:  # folders made for the lock and left empty
            made.rmdir()
    except OSError:
        pass  # not empty: something was written there
    fcntl.flock(fd, fcntl.LOCK_UN)
