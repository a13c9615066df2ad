"""File helpers shared by ConceptSet files and fit checkpoints: atomic writes, checksums,
the clean-up of temporary files a killed process left behind, and safetensors files read with a
one-line error."""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import Tensor


def atomic_write(path: str | os.PathLike, write: Callable[[str], object]) -> None:
    """Call `write(tmp_path)`, then rename the temporary file over `path`.

    The temporary file `.NAME.XXXX.tmp` lives in the same folder, so the rename is atomic: a
    reader sees the old file or the new one, never a partial one, even if the process dies
    mid-write (the leftover temporary file is removed by `remove_leftovers`). The file gets
    the mode a plain `open()` would give (0666 less the umask), is fsynced before the
    rename, and the folder is fsynced after it, so the rename survives a power cut.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:  # a full disk or a lost permission: say which file was being written
        Path(tmp).unlink(missing_ok=True)
        if err.filename is None:
            raise OSError(err.errno, err.strerror or str(err), str(path)) from err
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def read_safetensors(path: str | os.PathLike, framework: str = "pt", fix: str = "") -> tuple[dict[str, Any], dict[str, str]]:
    """Every tensor of a safetensors file (torch tensors, or numpy arrays with framework="numpy")
    and its metadata; a one-line ValueError naming the file when it does not read (`fix`: what
    to do then, appended)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework=framework) as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except Exception as err:  # noqa: BLE001 - a damaged header fails in many ways, some as a plain Exception
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"{path} is not a readable safetensors file ({why})" + (f": {fix}" if fix else "")) from None


def save_object(obj: Any, path: str | os.PathLike) -> None:
    """`torch.save` through a Python file, so a full disk raises OSError (ENOSPC), not torch's
    "unexpected pos" RuntimeError."""
    with open(path, "wb") as f:
        try:
            torch.save(obj, f)
        except RuntimeError as err:  # torch wraps the file's OSError in its own
            if isinstance(err.__context__, OSError):
                raise err.__context__ from None
            raise


def _umask() -> int:
    mask = os.umask(0o022)  # the only portable way to read it is to set it
    os.umask(mask)
    return mask


def fsync_dir(folder: str | os.PathLike) -> None:
    """Flush a folder's entries (a rename into it) to disk; a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a folder; the rename itself is still atomic
    finally:
        os.close(fd)


def remove_leftovers(folder: str | os.PathLike, names: Iterable[str]) -> list[Path]:
    """Delete the temporary files `atomic_write` leaves when killed before its rename,
    for files called `names` in `folder`; return what was removed."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    pattern = re.compile(r"\.(" + "|".join(re.escape(n) for n in names) + r")\.[A-Za-z0-9_]+\.tmp")
    removed = []
    for entry in folder.iterdir():
        if pattern.fullmatch(entry.name) and entry.is_file() and not entry.is_symlink():
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def tensor_digest(tensors: dict[str, Tensor]) -> str:
    """sha256 of named tensors: names, dtypes, shapes and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        hash_tensor(h, name, tensors[name])
    return h.hexdigest()


def hash_tensor(h: Any, name: str, t: Tensor) -> None:
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    t = t.detach().cpu().contiguous().reshape(-1)
    if t.numel():
        h.update(t.view(torch.uint8).numpy().tobytes())


def state_digest(state: Any) -> str:
    """sha256 of a nested state (dicts, lists, tuples, tensors, numbers, strings, None):
    any changed tensor byte, value, key or structure changes it."""
    h = hashlib.sha256()
    _walk(h, "", state)
    return h.hexdigest()


def _walk(h: Any, where: str, value: Any) -> None:
    if isinstance(value, Tensor):
        hash_tensor(h, where, value)
    elif isinstance(value, dict):
        h.update(f"{where}{{{len(value)}".encode())
        for key in sorted(value, key=repr):
            _walk(h, f"{where}/{key!r}", value[key])
    elif isinstance(value, (list, tuple)):
        h.update(f"{where}{type(value).__name__}[{len(value)}".encode())
        for i, item in enumerate(value):
            _walk(h, f"{where}/{i}", item)
    else:
        h.update(f"{where}={type(value).__name__}:{value!r};".encode())
