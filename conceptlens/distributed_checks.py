"""What the ranks of a distributed fit check about each other: that they run the same fit
(a fingerprint compared before the first step), which rank is gone when a collective fails,
and why a process group could not be joined. Every failure is one line.

    agree(comm, {"model": digest, "data (first 8 documents)": digest, "extractor 'km'": {...}})
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time
from typing import Any

import torch.distributed as dist

from conceptlens._io import state_digest

GRACE_S = 5.0
"""How long a rank that saw a collective fail waits for the others to say they saw it too."""


def fingerprint(model_digest: str, first_docs: list[str], extractors: dict[str, Any],
                options: dict[str, Any]) -> dict[str, Any]:
    """What every rank of one fit must share: the model's weights digest, the first global
    batch of documents (in stream order, before sharding), every extractor's type, options
    and starting state, and the fit's options (batch size, max_tokens, filters, ...)."""
    docs = hashlib.sha256()
    for doc in first_docs:
        raw = doc.encode("utf-8", "surrogatepass")
        docs.update(len(raw).to_bytes(8, "little") + raw)
    out: dict[str, Any] = {"model weights": model_digest, **{f"option {k}": v for k, v in options.items()},
                           "extractors": sorted(extractors)}
    for name, extractor in extractors.items():
        config = getattr(extractor, "config", None)
        options_of = dataclasses.asdict(config) if dataclasses.is_dataclass(config) and not isinstance(config, type) \
            else {}
        out[f"extractor {name!r}"] = {"type": type(extractor).__qualname__, **options_of,
                                      "state": _state(extractor)}
    out["data (the first global batch)"] = f"{len(first_docs)} documents, sha256 {docs.hexdigest()[:16]}"
    return out  # in this order: the first difference named is the cause, not its consequence


def _state(extractor: Any) -> str:
    try:
        return state_digest(extractor.state_dict())[:16]
    except Exception:  # noqa: BLE001 - an extractor without a state (or unfitted) has nothing to compare
        return "-"


def disagreement(prints: list[dict[str, Any]]) -> str | None:
    """The first field where some rank's fingerprint differs from rank 0's, as one line (None: all agree)."""
    mine = _leaves(prints[0])
    for rank, other in enumerate(prints[1:], 1):
        theirs = _leaves(other)
        for key in list(mine) + [k for k in theirs if k not in mine]:
            if mine.get(key) != theirs.get(key):
                return (f"the ranks of this distributed fit differ in {key}: rank 0 has {_short(mine.get(key))}, "
                        f"rank {rank} has {_short(theirs.get(key))}; every rank must run the same fit")
    return None


def _leaves(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix} {key}" if prefix else key
        if isinstance(value, dict) and value:
            out.update(_leaves(value, name))
        else:
            out[name] = value
    return out


def _short(value: Any, limit: int = 60) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def gone_ranks(rank: int, world: int, grace_s: float = GRACE_S) -> list[int] | None:
    """After a failed collective: the ranks that did not report the failure within `grace_s`
    through the rendezvous store (they died or hang). None when the store itself is gone
    (it lives in rank 0 unless torchrun's agent holds it)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"conceptlens/failed/{rank}", "1")
        keys = {r: f"conceptlens/failed/{r}" for r in range(world)}
        deadline = time.monotonic() + grace_s
        while True:
            missing = [r for r, key in keys.items() if not store.check([key])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - no store (or no connection to it): nothing more to learn
        return None


def failure(rank: int, world: int, what: str, err: BaseException, timeout_s: float) -> str:
    """The one-line message of a failed collective on `rank`, naming the ranks that are gone."""
    lines = str(err).strip().splitlines()
    first = lines[0] if lines else type(err).__name__
    gone = gone_ranks(rank, world, min(GRACE_S, timeout_s))
    if gone is None:
        who = "rank 0 (it holds the rendezvous store) is gone" if rank else "the rendezvous store is gone"
    elif gone:
        who = f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} died or stopped answering"
    else:
        who = "every rank saw it fail (no rank died: a timeout or ranks that ran different steps)"
    return (f"rank {rank}/{world}: {what} failed: {who} (timeout {timeout_s:g} s; the backend said: "
            f"{' '.join(first.split())[:200]})")


def join_error(err: BaseException, rank: str, world: str, timeout_s: float, where: str) -> str:
    """The one-line message of a process group that could not be joined."""
    text = " ".join(str(err).split())
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    count = f"{joined.group(1)} of {joined.group(2)} processes" if joined else "not every process"
    return (f"rank {rank}/{world}: {count} joined the distributed fit at {where} within {timeout_s:g} s; start "
            f"every rank (WORLD_SIZE={world}) or raise CONCEPTLENS_DIST_TIMEOUT ({type(err).__name__}: {text[:160]})")
