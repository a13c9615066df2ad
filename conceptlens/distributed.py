"""Fitting across processes with torch.distributed (gloo on CPU, nccl on GPU).

    torchrun --nproc-per-node 2 my_fit.py          # my_fit.py calls lens.fit(..., distributed=True)

A distributed fit equals one process fed the same documents with W times the batch: rank r
reads documents r, r + W, ... of the stream, so each global step holds the W*B documents one
process would take; each rank forwards its B documents, and the captured rows of every rank
are all-gathered and put back in document order. Every rank then runs the single-process
step (row filter, extractor updates) on the same global rows, so the row filter and every
extractor equal one process's, whatever the extractor. A site whose extractors are all updated
on one rank (below) is gathered to that rank alone, which alone filters it. The forward is
divided W ways, and so are the extractors: each one not sharded is updated on one rank only (`DistributedRun.place`;
the others would repeat the same work) and its state is broadcast to every rank at the end,
so the ranks end identical; a sharded one (`ShardedKMeans`, ...) is updated on every rank,
each on its own slice. The ranks advance in lockstep: each batch starts with a "who still has data"
all-reduce, and a rank whose shard ran out contributes no rows until every rank is done.
Before the first step the ranks compare a fingerprint of the fit (`distributed_checks`).
Rank 0 writes the checkpoints (one file holding every rank's state, each extractor's sent
by the rank that updates it and stored once unless sharded) and the run folder.
Every collective runs under the process group's timeout; a failure (a dead rank, a timeout)
raises `DistributedError` naming the operation and the ranks that are gone.

`Comm` also serves extractors driven by hand on per-rank data: with `extractor.comm` set,
k-means, VQ, Deleuzian (streaming mode; paper mode refuses a comm) and the SAEs all-reduce their step
statistics ("step" mode).
"""

from __future__ import annotations

import atexit
import datetime
import os
from collections.abc import Iterator
from itertools import chain, islice
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from conceptlens.distributed_checks import disagreement, join_error
from conceptlens.distributed_comm import DEFAULT_TIMEOUT_S, Comm, DistributedError
from conceptlens.distributed_placement import fill_ranks, first_reads, merge_rows, owners, readers, share

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
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as err:  # DistStoreError: a rank never joined
            where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
            raise DistributedError(join_error(err, os.environ["RANK"], os.environ["WORLD_SIZE"], timeout_s,
                                              where)) from None
        global _OWNED
        _OWNED = True
        atexit.unregister(shutdown)  # once: a script that fits under torchrun and just exits is covered too
        atexit.register(shutdown)
    return Comm(timeout_s=timeout_s)


_OWNED = False
"""Whether `init` created the default process group (then `shutdown` may destroy it)."""


SHUTDOWN_BARRIER_S = 30.0
"""How long `shutdown` waits for the other ranks before it destroys the group anyway."""


def shutdown() -> None:
    """Destroy the default process group if `init` created it, after every rank reached this point.
    A process that exits with a live gloo group can abort in the group's destructor ("terminate
    called without an active exception", SIGABRT), which turns a finished fit into a failed rank;
    `init` registers this to run at exit (before the interpreter's teardown destroys the group), and
    the CLI calls it before it exits. A group the caller initialised is left alone."""
    global _OWNED
    if _OWNED and dist.is_available() and dist.is_initialized():
        quiesce()
        dist.destroy_process_group()
    _OWNED = False


def quiesce(timeout_s: float = SHUTDOWN_BARRIER_S) -> None:
    """Wait (at most `timeout_s`) until every rank of a gloo default group gets here, so that no rank
    tears its connections down while another still finishes its last collective (gloo's
    `monitored_barrier`). A rank that died or does not come is not waited for further: the caller
    is leaving anyway. Other backends are not waited on: their barrier takes no timeout of its own,
    and exiting must not hang on a dead rank."""
    try:
        if dist.get_world_size() > 1 and dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError):
        pass


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
    """Documents rank, rank + world, rank + 2 world, ...: with per-rank batches of B, global
    step s holds documents s*W*B ... (s+1)*W*B - 1, those one process with batch W*B takes."""
    for i, text in enumerate(texts):
        if i % comm.world == comm.rank:
            yield text


class GlobalStep(NamedTuple):
    """The rows of one step of every rank, in document order (as one process with the global batch has them)."""

    acts: dict[str, Tensor]
    """Site -> `(N, ...)` rows of every rank's documents, document by document."""
    row: Tensor
    """`(N,)` document of each row within the global batch."""
    position: Tensor
    """`(N,)` position of each row in its document."""
    tokens: int
    """Real tokens of the global batch."""
    first_doc: int
    """Documents of every rank before this step."""
    ids: Tensor | None
    """`(W*B, T)` token ids of the global batch, -1 on padding (when asked for)."""


class DistributedRun:
    """What `fit(..., distributed=True)` does besides the single-process step: shard, agree, gather."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.owners: dict[str, int | None] = {}
        """Extractor name -> the rank that updates it (None: every rank; see `place`)."""
        self.readers: dict[str, list[int] | None] = {}
        """Site -> the ranks that receive its rows (None or absent: every rank; see `place`)."""

    @classmethod
    def start(cls) -> DistributedRun:
        timeout = float(os.environ.get("CONCEPTLENS_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
        return cls(init(timeout_s=timeout))

    @property
    def writes(self) -> bool:
        """Whether this rank writes files (rank 0)."""
        return self.comm.rank == 0

    def shard(self, texts: Iterator[str], batch_size: int, fingerprint: Any) -> Iterator[str]:
        """This rank's documents, after every rank agreed on `fingerprint(first_docs)` (the
        whole first global batch, read before sharding), or a one-line `DistributedError`."""
        head = list(islice(texts, batch_size * self.comm.world))
        prints = self.comm.gather_objects(fingerprint(head))
        differ = disagreement(prints)
        if differ is not None:
            raise DistributedError(f"rank {self.comm.rank}/{self.comm.world}: {differ}")
        return shard(chain(head, texts), self.comm)

    def lockstep(self, batches: Iterator[list[str]]) -> Iterator[list[str]]:
        return lockstep(batches, self.comm)

    def pad_to_global_width(self, batch: dict[str, Tensor], real: bool = True) -> dict[str, Tensor]:
        """`batch` (right-padded `input_ids`, `attention_mask`) padded to the widest batch of any rank
        this step: one process pads the global batch to its longest document, and a forward's float
        results on the real tokens can change with the padded width. `real` False: a stub batch (no
        document on this rank), whose width does not count."""
        width = batch["input_ids"].shape[1]
        wanted = self.comm.max_int(width if real else 0)
        if wanted <= width:
            return batch
        return {key: torch.nn.functional.pad(value, (0, wanted - width), value=0) for key, value in batch.items()}

    def agree_on_progress(self, tokens: int, batches: int) -> None:
        """After a resume: every rank is at the same step, or a one-line `DistributedError`."""
        at = self.comm.gather_objects((tokens, batches))
        if len(set(at)) > 1:
            where = ", ".join(f"rank {r} at {t:,} tokens" for r, (t, _) in enumerate(at))
            raise DistributedError(f"rank {self.comm.rank}/{self.comm.world}: the ranks resumed at different points "
                                   f"({where}): every rank must read the same checkpoint (the run folder on a "
                                   "file system they share)")

    def gather_step(self, acts: dict[str, Tensor], meta: Any, ids: Tensor, n_tokens: int, documents: int,
                    with_ids: bool = False) -> GlobalStep:
        """Every rank's rows of this step in document order, at the sites this rank reads
        (`place`): rank r's batch row j is document j*W + r of the global batch. `meta`: the
        capture's (row, position) of `acts`; `ids`: `(B, T)` token ids of this rank's documents,
        -1 on padding; n_tokens 0: no rows here."""
        comm, world = self.comm, self.comm.world
        n_rows = int(meta.row.numel()) if n_tokens else 0
        n_docs = int(ids.shape[0])
        head = torch.zeros(world, 5, dtype=torch.int64)
        head[comm.rank] = torch.tensor([n_rows, n_docs, n_tokens, documents, ids.shape[1] if n_docs else 0])
        head = comm.sum_(head)
        rows, docs = head[:, 0].tolist(), head[:, 1].tolist()
        local = torch.stack([meta.row[:n_rows].cpu() * world + comm.rank, meta.position[:n_rows].cpu()], 1)
        where = comm.gather_rows(local.long(), rows)
        order = torch.argsort(where[:, 0], stable=True)  # rank order -> document order
        gathered = {}
        for site in sorted(acts):  # a site read on one rank only goes to that rank
            readers = self.readers.get(site)
            if readers is not None and len(readers) == 1:
                mine = comm.gather_rows_on(acts[site][:n_rows], rows, readers[0])
            else:
                mine = comm.gather_rows(acts[site][:n_rows], rows)
            if mine is not None and self.reads(site):
                gathered[site] = _take(mine, order)
        every = None
        if with_ids:
            width = int(head[:, 4].max())
            mine = torch.nn.functional.pad(ids[:n_docs].cpu(), (0, width - ids.shape[1]), value=-1)
            doc = torch.cat([torch.arange(n) * world + r for r, n in enumerate(docs)])
            every = comm.gather_rows(mine, docs)[torch.argsort(doc)]
        return GlobalStep(gathered, where[order, 0], where[order, 1], int(head[:, 2].sum()),
                          int(head[:, 3].sum()), every)

    def place(self, extractors: dict[str, Any], sites: dict[str, tuple[str, ...]] | None = None) -> None:
        """Decide which rank updates each extractor (`distributed_placement.owners`) and, given
        the sites each one reads, which ranks read each site (the others never receive its
        rows nor filter them)."""
        self.owners = owners(extractors, self.comm.world)
        self.readers = readers(self.owners, sites or {}, self.comm.world)

    def updates(self, name: str) -> bool:
        """Whether this rank updates extractor `name`."""
        owner = self.owners.get(name)
        return owner is None or owner == self.comm.rank

    def reads(self, site: str) -> bool:
        """Whether this rank receives (and filters) the rows of `site`."""
        ranks = self.readers.get(site)
        return ranks is None or self.comm.rank in ranks

    @property
    def routed(self) -> bool:
        """Whether some site's rows go to some ranks only."""
        return any(ranks is not None for ranks in self.readers.values())

    def share(self, extractors: dict[str, Any], row_filter: Any = None) -> None:
        """After the last update: every rank's copy of an extractor becomes its owner's, and
        its row filter holds every site's counts and norms (each from the first rank that reads it)."""
        share(self.comm, self.owners, extractors)
        if row_filter is not None and self.routed:
            mine = first_reads(row_filter.state_dict(), self.readers, self.comm.rank)
            row_filter.load_state_dict(merge_rows(self.comm.gather_objects(mine)))

    def gather_checkpoint(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """Every rank's checkpoint state, on rank 0 (None elsewhere). `state["extractors"]`
        holds the extractors this rank updates; rank 0 fills each rank's entry with the owner's
        state (`distributed_placement.fill_ranks`): an extractor not sharded is sent once and
        stored once, and every rank resumes from its current state."""
        states = self.comm.gather_objects_on(state, dst=0)
        if states is None:
            return None
        if self.routed:  # every rank resumes with every site's filter state (one process's)
            rows = merge_rows([first_reads(state["rows"], self.readers, r) for r, state in enumerate(states)])
            states = [{**state, "rows": rows} for state in states]
        return {"world_size": self.comm.world, "ranks": fill_ranks(states, self.owners)}


def _take(x: Tensor, order: Tensor) -> Tensor:
    return x[order.to(x.device)]


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
