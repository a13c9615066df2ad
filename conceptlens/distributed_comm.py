"""The collectives of a distributed fit over one process group (`Comm`), and their one error.

Re-exported by `conceptlens.distributed`, which joins the group and runs the fit's steps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from conceptlens.distributed_checks import failure

__all__ = ["DEFAULT_TIMEOUT_S", "Comm", "DistributedError"]

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
            raise DistributedError(failure(self.rank, self.world, what, err, self.timeout_s)) from None

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

    def gather_rows(self, x: Tensor, sizes: list[int] | None = None) -> Tensor:
        """The rows `(n_r, ...)` of every rank concatenated in rank order (same on every rank);
        `sizes`: every rank's n_r when already known (saves a collective)."""
        if self.world == 1:
            return x
        sizes = self.sizes(x.shape[0]) if sizes is None else sizes
        pad = x.new_zeros(max(sizes), *x.shape[1:]).to(self.device)
        pad[: x.shape[0]] = x.to(self.device)
        parts = [torch.empty_like(pad) for _ in range(self.world)]
        self._call("all_gather", lambda: dist.all_gather(parts, pad, group=self.group))
        return torch.cat([p[:n] for p, n in zip(parts, sizes)]).to(x.device)

    def gather_rows_on(self, x: Tensor, sizes: list[int], dst: int) -> Tensor | None:
        """As `gather_rows` (every rank's `sizes` known), on rank `dst` only (None elsewhere)."""
        if self.world == 1:
            return x
        pad = x.new_zeros(max(sizes), *x.shape[1:]).to(self.device)
        pad[: x.shape[0]] = x.to(self.device)
        parts = [torch.empty_like(pad) for _ in range(self.world)] if self.rank == dst else None
        self._call("gather", lambda: dist.gather(pad, parts, dst=dst, group=self.group))
        return None if parts is None else torch.cat([p[:n] for p, n in zip(parts, sizes)]).to(x.device)

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

    def gather_objects_on(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's picklable `obj`, in rank order, on rank `dst` only (None elsewhere)."""
        if self.world == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.rank == dst else None
        self._call("gather_object", lambda: dist.gather_object(obj, out, dst=dst, group=self.group))
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s picklable `obj`, on every rank."""
        if self.world == 1:
            return obj
        box = [obj if self.rank == src else None]
        self._call("broadcast_object_list", lambda: dist.broadcast_object_list(box, src=src, group=self.group))
        return box[0]

    def barrier(self) -> None:
        if self.world > 1:
            # a tiny all-reduce rather than dist.barrier: it honours the group's timeout on gloo
            self.sum_(torch.zeros(1))
