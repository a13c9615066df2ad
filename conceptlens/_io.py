"""File helpers shared by ConceptSet files and fit checkpoints."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


def atomic_write(path: str | os.PathLike, write: Callable[[str], object]) -> None:
    """Call `write(tmp_path)`, then rename the temporary file over `path`.

    The temporary file lives in the same folder, so the rename is atomic: a reader sees the
    old file or the new one, never a partial one, even if the process dies mid-write.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
