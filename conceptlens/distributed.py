"""Fitting across processes with torch.distributed (gloo on CPU, nccl on GPU).

    torchrun --nproc-per-node 2 my_fit.py          # my_fit.py calls lens.fit(..., distributed=True)

Each rank reads every world-th document (rank r takes documents r, r + W, ...). Extractors
stay identical on every rank: k-means, Deleuzian and VQ all-reduce their per-step
statistics before each centre / code update, SAEs all-reduce their gradients (weighted by
each rank's rows, so W ranks with per-rank batch B take the step of one process with batch
W*B), and statistics (q/k moments, co-activation counts) are summed once at the end. The
ranks advance in lockstep: each batch starts with a "who still has data" all-reduce, and a
rank whose shard ran out feeds empty batches until every rank is done, so uneven shards
never hang. Rank 0 writes the checkpoints (one file holding every rank's state) and the run
folder. Every collective runs under the process group's timeout; a failure (a dead rank, a
timeout) raises `DistributedError` naming the operation.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

DEFAULT_TIMEOUT_S = 300.0


class DistributedError(RuntimeError):
    """A collective failed: another rank died, or did not answer within the timeout."""


class Comm:
    """The collectives extractors and the fit loop use, over one process group.

    Tensors are moved to the backend's device (CPU for gloo, the current GPU for nccl) and
    back; every call turns a backend failure into a `DistributedError`.
    """

    def __init__(self, group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise DistributedError("no torch.distributed process group: start under torchrun "
                                   "or call conceptlens.distributed.init() first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout_s = timeout_s
        backend = dist.get_backend(group)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def __repr__(self) -> str:
        return f"Comm(rank={self.rank}, world={self.world})"

    def _call(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except (RuntimeError, ValueError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise DistributedError(f"rank {self.rank}/{self.world}: {what} failed (another rank died or did "
                                   f"not answer within {self.timeout_s:g} s): {first}") from None

    def sum_(self, t: Tensor) -> Tensor:
        """All-reduce (sum) `t`; returns the summed tensor on `t`'s device and dtype."""
        if self.world == 1:
            return t
        buf = t.detach().to(self.device).clone()
        self._call("all_reduce", lambda: dist.all_reduce(buf, group=self.group))
        return buf.to(t.device, t.dtype)

    def max_(self, t: Tensor) -> Tensor:
        if self.world == 1:
            return t
        buf = t.detach().to(self.device).clone()
        self._call("all_reduce(max)", lambda: dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group))
        return buf.to(t.device, t.dtype)

    def max_int(self, value: int) -> int:
        return int(self.max_(torch.tensor([value], dtype=torch.int64)).item())

    def sizes(self, n: int) -> list[int]:
        """Every rank's `n`, in rank order."""
        one = torch.zeros(self.world, dtype=torch.int64)
        one[self.rank] = n
        return self.sum_(one).tolist()

    def gather_rows(self, x: Tensor) -> Tensor:
        """The rows `(n_r, ...)` of every rank concatenated in rank order (same on every rank)."""
        if self.world == 1:
            return x
        sizes = self.sizes(x.shape[0])
        pad = x.new_zeros(max(sizes), *x.shape[1:]).to(self.device)
        pad[: x.shape[0]] = x.to(self.device)
        parts = [torch.empty_like(pad) for _ in range(self.world)]
        self._call("all_gather", lambda: dist.all_gather(parts, pad, group=self.group))
        return torch.cat([p[:n] for p, n in zip(parts, sizes)]).to(x.device)

    def broadcast_(self, t: Tensor, src: int = 0) -> Tensor:
        if self.world == 1:
            return t
        buf = t.detach().to(self.device).clone()
        self._call("broadcast", lambda: dist.broadcast(buf, src=src, group=self.group))
        return buf.to(t.device, t.dtype)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        self._call("all_gather_object", lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def barrier(self) -> None:
        if self.world > 1:
            # a tiny all-reduce rather than dist.barrier: it honours the group's timeout on gloo
            self.sum_(torch.zeros(1))


def init(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Comm:
    """Join (or reuse) the default process group from torchrun's environment variables
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); nccl when a GPU is visible, else gloo."""
    if not dist.is_available():
        raise DistributedError("this torch build has no torch.distributed")
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise DistributedError(f"distributed=True needs torchrun (environment variables {missing} are unset) "
                                   "or a process group initialised with torch.distributed.init_process_group")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        global _OWNED
        _OWNED = True
    return Comm(timeout_s=timeout_s)


_OWNED = False
"""Whether `init` created the default process group (then `shutdown` may destroy it)."""


def shutdown() -> None:
    """Destroy the default process group if `init` created it. A process that exits with a live
    gloo group can abort in the group's destructor ("terminate called without an active
    exception", SIGABRT), which turns a finished fit into a failed rank; the CLI calls this
    before it exits. A group the caller initialised is left alone."""
    global _OWNED
    if _OWNED and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _OWNED = False


def attach(extractors: dict[Any, Any], comm: Comm) -> None:
    """Give every extractor the communicator; refuse those that cannot be synchronised."""
    for key, extractor in extractors.items():
        mode = getattr(extractor, "distributed", None)
        if mode not in ("step", "merge"):
            raise ValueError(f"extractor for {key!r} ({type(extractor).__name__}) cannot be fitted with "
                             "distributed=True; supported: StreamingKMeans, Deleuzian, the SAEs, VQCodebook, "
                             "QueryKeyMoments, CoactivationStats")
        extractor.comm = comm if mode == "step" else None


def reduce_by_merge(extractors: dict[Any, Any], comm: Comm) -> None:
    """At the end of a fit: every statistics extractor ("merge" mode) becomes the merge of all
    ranks' states, in rank order (exact for sums), the same on every rank."""
    for extractor in extractors.values():
        if getattr(extractor, "distributed", None) != "merge":
            continue
        states = comm.gather_objects(extractor.state_dict())
        merged = type(extractor).from_state(states[0])
        for state in states[1:]:
            merged.merge(state)
        extractor.load_state_dict(merged.state_dict())


def lockstep(batches: Iterator[list[str]], comm: Comm) -> Iterator[list[str]]:
    """This rank's batches, then empty ones while any other rank still has data."""
    mine: Iterator[list[str]] | None = batches
    while True:
        docs = next(mine, None) if mine is not None else None
        if docs is None:
            mine = None
        if comm.max_int(0 if docs is None else 1) == 0:
            return
        yield docs or []


def shard(texts: Iterator[str], comm: Comm) -> Iterator[str]:
    """Documents rank, rank + world, rank + 2 world, ..."""
    for i, text in enumerate(texts):
        if i % comm.world == comm.rank:
            yield text


class DistributedRun:
    """What `fit(..., distributed=True)` needs besides the extractors' own synchronisation."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    @classmethod
    def start(cls, extractors: dict[Any, Any]) -> DistributedRun:
        timeout = float(os.environ.get("CONCEPTLENS_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
        run = cls(init(timeout_s=timeout))
        attach(extractors, run.comm)
        return run

    @property
    def writes(self) -> bool:
        """Whether this rank writes files (rank 0)."""
        return self.comm.rank == 0

    def shard(self, texts: Iterator[str]) -> Iterator[str]:
        return shard(texts, self.comm)

    def lockstep(self, batches: Iterator[list[str]]) -> Iterator[list[str]]:
        return lockstep(batches, self.comm)

    def total(self, n_tokens: int) -> int:
        """The tokens of this step summed over the ranks."""
        return int(self.comm.sum_(torch.tensor([n_tokens], dtype=torch.int64)).item())

    def gather_checkpoint(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """Every rank's checkpoint state, on rank 0 (None elsewhere)."""
        states = self.comm.gather_objects(state)
        if not self.writes:
            return None
        return {"world_size": self.comm.world, "ranks": states}

    def finish(self, extractors: dict[Any, Any]) -> None:
        """After the flushes: statistics summed over the ranks; then wait for rank 0's files."""
        reduce_by_merge(extractors, self.comm)
        for extractor in extractors.values():
            if getattr(extractor, "comm", None) is self.comm:
                extractor.comm = None  # an extractor outlives the fit; its later updates are local


def own_checkpoint(saved: dict[str, Any], path: Any, run: DistributedRun | None) -> dict[str, Any]:
    """This rank's part of a checkpoint written by `DistributedRun.gather_checkpoint`."""
    world = saved.get("world_size", 1) if "ranks" in saved else 1
    mine = 1 if run is None else run.comm.world
    if world != mine or not isinstance(saved.get("ranks", [None] * world), list):
        raise ValueError(f"checkpoint {path} was written by a fit on {world} process(es); this fit runs on "
                         f"{mine}: resume with the same world size, or use resume=False")
    if "ranks" not in saved:
        return saved
    return saved["ranks"][0 if run is None else run.comm.rank]
