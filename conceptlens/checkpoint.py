"""Fit checkpoints: the state a streaming fit saves and resumes from, and its fingerprint.

    state = FitState(RowFilter(filters), {"blocks.3.resid_out": km}, fit_fingerprint(model, ...))
    texts = state.open(path, texts, resume=True)   # texts after the documents already consumed
    state.advance(docs, n_tokens)                  # after each batch
    state.save(path)

A checkpoint holds the extractor states, the row filter, the torch RNG state, the data
position (with the tokens each extractor with a spent budget of its own was fed) and a sha256 of
the documents consumed so far. It is written atomically with a
sha256 of its whole content and read with `torch.load(weights_only=True)`, so a hostile
file can fail to load but never runs code, and a flipped bit is refused, not resumed. A
resume is refused, with the caller's extractors left as they were, when the model (config
and a sample of its weights), the sites, extractors, batching or the data differ.
"""

from __future__ import annotations

import copy
import hashlib
import json
import tempfile
from itertools import islice
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from conceptlens._content import check_depth, check_extractor, check_no_nan, field
from conceptlens._io import atomic_write, hash_tensor, remove_leftovers, save_object, state_digest
from conceptlens.filters import RowFilter

CHECKPOINT = "checkpoint.pt"
FORMAT, VERSION = "conceptlens.fit-checkpoint", 2
STATE_KEYS = ("fingerprint", "data_sha256", "progress", "rows", "torch_rng", "extractors")
WHAT_DIFFERS = {"model": "another model (its config or weights differ)",
                "extractors": "other sites or extractors", "batching": "other batch_size, max_length, filters or dtype"}


class FitState:
    """Everything a checkpoint holds: progress, row filter, RNG state and the extractors."""

    def __init__(self, row_filter: RowFilter, extractors: dict[str, Any], fingerprint: dict[str, Any]) -> None:
        self.row_filter = row_filter  # which captured rows reach the extractors, with its counts
        self.extractors = extractors
        self.fingerprint = fingerprint
        self.also_resumes: list[dict[str, Any]] = []
        """Fingerprints an earlier version wrote for this same fit (a checkpoint holding one resumes)."""
        self.tokens = self.documents = self.batches = 0
        self.last_batch_from: int | None = 0
        """Tokens before the last batch: a fit of max_tokens above it stops where this did (None: a
        checkpoint from before it was recorded, resumed and not yet advanced)."""
        self.stopped: dict[str, int] = {}  # extractor -> tokens it was fed, once its own budget is reached
        self._data = hashlib.sha256()  # of the documents consumed so far, in order
        self.run: Any = None  # a conceptlens.distributed.DistributedRun in a distributed fit

    def advance(self, docs: list[str], n_tokens: int) -> None:
        """Count one batch of documents that has been fed to the extractors."""
        for doc in docs:
            _hash_doc(self._data, doc)
        self.documents += len(docs)
        self.batches += 1
        self.last_batch_from = self.tokens
        self.tokens += n_tokens

    def save(self, path: Path) -> None:
        state = {
            "fingerprint": self.fingerprint,
            "data_sha256": self._data.hexdigest(),
            "progress": {"tokens": self.tokens, "documents": self.documents, "batches": self.batches,
                         "stopped": dict(self.stopped)} | ({} if self.last_batch_from is None else
                                                         {"last_batch_from": self.last_batch_from}),
            "rows": self.row_filter.state_dict(),  # the key files have always used
            "torch_rng": torch.get_rng_state(),
            "extractors": {name: e.state_dict() for name, e in self.extractors.items()
                           if self.run is None or self.run.updates(name)},  # (distributed: the ones this rank updates)
        }
        if self.run is not None:  # every rank's state in one file, written by rank 0
            state = self.run.gather_checkpoint(state)
            if state is None:
                return
        payload = {"format": FORMAT, "version": VERSION, "sha256": state_digest(state), "state": state}
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: save_object(payload, tmp))

    def open(self, path: Path, texts: Iterator[str], *, resume: bool = True,
             widths: dict[str, int] | None = None, max_tokens: int | None = None) -> Iterator[str]:
        """Before a fit writing to `path`: check that its folder can be written, remove
        temporary files a killed run left, and resume from `path` when it exists (see `resume`)."""
        _writable_folder(path.parent)
        remove_leftovers(path.parent, (path.name,))
        for folder in sorted((path.parent / "concepts").glob("*")):
            remove_leftovers(folder, ("concepts.safetensors", "config.json"))
        if path.exists() and not path.is_file():
            raise ValueError(f"checkpoint {path} is a {'folder' if path.is_dir() else 'special file'}, not a file; "
                             "remove it or use another checkpoint_dir")
        if resume and path.is_file():
            return self.resume(path, texts, widths, max_tokens)
        return texts

    def resume(self, path: Path, texts: Iterator[str], widths: dict[str, int] | None = None,
               max_tokens: int | None = None) -> Iterator[str]:
        """Load the checkpoint at `path`; return `texts` past the documents it had consumed.

        Every check (readability, checksum, structure, fingerprint, the budget, the consumed
        documents, each extractor's state) runs before anything of the caller's is changed. A
        fit with `max_tokens` resumes only a checkpoint it could have written itself: one whose
        last batch began below `max_tokens` (a fit stops at the batch that reaches its budget).
        """
        state = read_checkpoint(path)
        if self.run is not None or "ranks" in state:  # this rank's part of a distributed checkpoint
            from conceptlens.distributed import own_checkpoint

            state = own_checkpoint(state, path, self.run)
            _check_structure(path, state)
        self._check_fingerprint(path, state["fingerprint"])
        _check_budget(path, state["progress"], max_tokens)
        check_extractor_states(path, state["extractors"], self.extractors, widths or {})
        documents = state["progress"]["documents"]
        data, consumed = hashlib.sha256(), 0
        for doc in islice(texts, documents):  # hashed as read: a resume after millions of documents holds none
            _hash_doc(data, doc)
            consumed += 1
        if consumed < documents or data.hexdigest() != state["data_sha256"]:
            raise ValueError(f"checkpoint {path} was written by a fit of other data: its first {documents} documents "
                             f"differ from these; use another checkpoint_dir or resume=False (--no-resume on the command line)")
        rows = copy.deepcopy(self.row_filter)
        try:
            rows.load_state_dict(state["rows"])
        except Exception as err:  # noqa: BLE001
            raise ValueError(f"checkpoint {path}: its row filter state does not load: {_one_line(err)}") from None
        for name, extractor in self.extractors.items():  # checked on copies above
            try:
                extractor.load_state_dict(state["extractors"][name])
            except Exception as err:  # noqa: BLE001 - only an extractor that could not be copied gets here
                raise ValueError(f"checkpoint {path}: the state of {name} does not load: {_one_line(err)}; resume "
                                 "with the settings it was written with, or start again with resume=False "
                                 "(--no-resume on the command line)") from None
        self.row_filter.load_state_dict(state["rows"])
        torch.set_rng_state(state["torch_rng"])
        progress = state["progress"]
        self.tokens, self.documents, self.batches = progress["tokens"], progress["documents"], progress["batches"]
        self.last_batch_from = progress.get("last_batch_from")  # (checkpoints from before it: unknown, kept so)
        self.stopped = dict(progress.get("stopped", {}))  # (checkpoints from before extractor budgets: none)
        self._data = data
        return texts

    def _check_fingerprint(self, path: Path, stored: Any) -> None:
        if not isinstance(stored, dict):
            raise ValueError(f"checkpoint {path}: its fingerprint is not a dict")
        if stored in self.also_resumes:
            return
        for part, what in WHAT_DIFFERS.items():
            if stored.get(part) != self.fingerprint.get(part):
                if part == "batching" and isinstance(stored.get(part), dict):  # name the options that differ
                    ours, theirs = self.fingerprint[part], stored[part]
                    what = "other " + ", ".join(k if k != "sites" else "sites for its named extractors"
                                                for k in sorted(ours.keys() | theirs.keys())
                                                if ours.get(k) != theirs.get(k))
                raise ValueError(f"checkpoint {path} was written by a fit of {what}; "
                                 "use another checkpoint_dir or resume=False (--no-resume on the command line)")


def _writable_folder(folder: Path) -> None:
    """Create `folder` if needed and check it takes files: a one-line ValueError before any work."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        reason = "it is a file" if folder.is_file() else err.strerror or type(err).__name__
        raise ValueError(f"checkpoint_dir {str(folder)!r} cannot be written: {reason}") from None


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The verified state of a checkpoint file; a one-line ValueError naming what is wrong."""
    try:
        payload = torch.load(path, weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same advice
        raise ValueError(f"cannot read checkpoint {path}: {_one_line(err)}; delete it or pass resume=False (--no-resume on the command line)") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path} is not a conceptlens fit checkpoint (or one from an older version, without "
                         "checksum); delete it or pass resume=False (--no-resume on the command line)")
    if payload.get("version") != VERSION:
        raise ValueError(f"checkpoint {path} has version {payload.get('version')!r}; this version reads {VERSION}")
    state = check_depth(path, payload.get("state"))
    if not isinstance(state, dict) or payload.get("sha256") != state_digest(state):
        raise ValueError(f"checkpoint {path} is corrupt: its content does not match its sha256; "
                         "delete it or pass resume=False (--no-resume on the command line)")
    if "ranks" not in state:
        _check_structure(path, state)
        return state
    world = field(path, "world_size", state.get("world_size"), int, low=1, high=2**16)
    ranks = field(path, "ranks", state["ranks"], list)
    if len(ranks) != world:
        raise ValueError(f"{path}: ranks holds {len(ranks)} states; world_size says {world}")
    for i, part in enumerate(ranks):
        _check_structure(f"{path} (rank {i})", field(path, f"ranks/{i}", part, dict))
    return state


def check_budget(path: Path, max_tokens: int | None) -> None:
    """Before anything is written for a fit that will resume `path`: the one-line ValueError its resume
    would raise when the checkpoint is past `max_tokens`. Reads only its progress (memory-mapped, not
    verified: a file that does not read is left for the resume to report)."""
    if max_tokens is None or not path.is_file():
        return
    progress = None
    for mmap in (True, False):  # (a file in torch's legacy format cannot be memory-mapped)
        try:
            state = torch.load(path, weights_only=True, mmap=mmap)["state"]
            progress = (state["ranks"][0] if "ranks" in state else state)["progress"]
            break
        except Exception:  # noqa: BLE001 - the resume reads it again, and says what is wrong
            continue
    if not isinstance(progress, dict):
        return
    began = progress.get("last_batch_from")
    if isinstance(progress.get("tokens"), int) and isinstance(began, int) and not isinstance(began, bool):
        _check_budget(path, progress, max_tokens)  # (a damaged field is for the resume to name)


def _check_budget(path: Path, progress: dict[str, Any], max_tokens: int | None) -> None:
    """Refuse a checkpoint past `max_tokens`: its last batch began at or above it, so a fit of
    `max_tokens` would have stopped before it (a checkpoint from before `last_batch_from` is not checked)."""
    began = progress.get("last_batch_from")
    if max_tokens is not None and began is not None and began >= max_tokens:
        raise ValueError(f"checkpoint {path} holds a fit of {progress['tokens']:,} tokens, past max_tokens="
                         f"{max_tokens:,}: a fit stops at the batch that reaches its budget, and this one's last "
                         f"batch began at {began:,}; give max_tokens above {began:,}, or start again with "
                         "resume=False (--max-tokens, --no-resume or --overwrite on the command line)")


def _check_structure(path: Path | str, state: dict[str, Any]) -> None:
    missing = [key for key in STATE_KEYS if key not in state]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {', '.join(map(repr, missing))}")
    progress = state["progress"]
    if not isinstance(progress, dict) or not all(
            isinstance(progress.get(k), int) and not isinstance(progress.get(k), bool) and progress[k] >= 0
            for k in ("tokens", "documents", "batches")):
        raise ValueError(f"checkpoint {path}: progress must hold non-negative ints tokens, documents, batches; "
                         f"got {progress!r}")
    began = progress.get("last_batch_from", 0)
    if not isinstance(began, int) or isinstance(began, bool) or not 0 <= began <= progress["tokens"]:
        raise ValueError(f"checkpoint {path}: progress's last_batch_from must be an int from 0 to its tokens "
                         f"({progress['tokens']}); got {began!r}")
    stopped = progress.get("stopped", {})
    if not isinstance(stopped, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0 for k, v in stopped.items()):
        raise ValueError(f"checkpoint {path}: progress's stopped must map extractor names to token counts; "
                         f"got {stopped!r}")
    rng, expected = state["torch_rng"], torch.get_rng_state()
    if not isinstance(rng, Tensor) or rng.dtype != expected.dtype or rng.shape != expected.shape:
        got = f"{rng.dtype} {tuple(rng.shape)}" if isinstance(rng, Tensor) else type(rng).__name__
        raise ValueError(f"checkpoint {path}: torch_rng is not a torch RNG state (expected {expected.dtype} "
                         f"{tuple(expected.shape)}, got {got})")
    rows = state["rows"]
    if not (isinstance(rows, dict) and isinstance(rows.get("norms"), dict) and isinstance(rows.get("counts"), dict)):
        raise ValueError(f"checkpoint {path}: rows must be a row filter state with 'norms' and 'counts'")
    if not isinstance(state["extractors"], dict) or not isinstance(state["data_sha256"], str):
        raise ValueError(f"checkpoint {path}: extractors must be a dict and data_sha256 a str")


def check_extractor_states(path: Path, states: dict[str, Any], extractors: dict[str, Any],
                           widths: dict[str, int]) -> None:
    """Each extractor's state is there, is for its site's width, and loads into a copy."""
    if sorted(states) != sorted(extractors):
        raise ValueError(f"checkpoint {path} holds extractors {sorted(states)}; this fit has {sorted(extractors)}")
    for name, extractor in extractors.items():
        state = states[name]
        d = state.get("d") if isinstance(state, dict) else None
        if name in widths and isinstance(d, int) and d != widths[name]:
            raise ValueError(f"checkpoint {path}: the state of {name} is for width {d}; the site has width "
                             f"{widths[name]}")
        check_no_nan(f"checkpoint {path}", f"extractors/{name}", state)
        try:
            probe = copy.deepcopy(extractor)
        except Exception:  # noqa: BLE001 - an extractor holding something uncopyable is not probed
            continue
        try:
            probe.load_state_dict(state)
        except Exception as err:  # noqa: BLE001 - a wrong state can fail in any way; report it in one line
            raise ValueError(f"checkpoint {path}: the state of {name} does not load: {_one_line(err)}; resume "
                             "with the settings it was written with, or start again with resume=False "
                             "(--no-resume on the command line)") from None
        check_extractor(f"checkpoint {path}", name, probe, widths.get(name))


def fit_fingerprint(model: nn.Module, extractors: dict[str, Any], batching: dict[str, Any]) -> dict[str, Any]:
    """What must not change between a checkpoint and its resume (the data is checked apart,
    by a hash of the documents consumed)."""
    return {"model": model_fingerprint(model),
            "extractors": sorted([name, type(e).__qualname__] for name, e in extractors.items()),
            "batching": json.loads(json.dumps(batching, sort_keys=True, default=str))}


def model_fingerprint(model: nn.Module, n_tensors: int = 5, sample: int = 4096) -> str:
    """sha256 of the model's class, config and a strided sample of `n_tensors` weights
    spread over its depth (at most `sample` values each): cheap on any model size, and
    different for other weights of the same architecture."""
    h = hashlib.sha256(type(model).__qualname__.encode())
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        volatile = {"_name_or_path", "name_or_path", "transformers_version", "_attn_implementation_autoset",
                    "_attn_implementation", "_attn_implementation_internal", "_commit_hash"}
        items = {k: v for k, v in config.to_dict().items() if k not in volatile}
        h.update(json.dumps(items, sort_keys=True, default=str).encode())
    params = list(model.named_parameters())
    picks = sorted({round(i * (len(params) - 1) / max(n_tensors - 1, 1)) for i in range(n_tensors)}) if params else []
    for i in picks:
        name, p = params[i]
        if p.device.type == "meta":  # offloaded or not materialised: only its name and shape
            h.update(f"{name}|meta|{tuple(p.shape)}".encode())
            continue
        flat = p.detach().reshape(-1)
        hash_tensor(h, f"{name}{tuple(p.shape)}", flat[:: max(1, flat.numel() // sample)][:sample])
    return h.hexdigest()


def _hash_doc(h: Any, doc: str) -> None:
    raw = doc.encode("utf-8", "surrogatepass")
    h.update(len(raw).to_bytes(8, "little"))
    h.update(raw)


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")
