"""Exact streaming top-N per concept: the same N entries as sorting every activation seen.

    top = TopN(n_concepts=64, k=16, window=(8, 4))
    top.update(z, doc, pos, ids, first_doc)    # z: (N, n) activations of N rows, in stream order
    top.values, top.doc, top.pos, top.window_ids, top.window_acts

Order: larger value first; equal values by (document, position), earlier first, so the
result does not depend on how the stream was cut into batches, on a resume, or on merging
shards. A batch's k best per concept are ranked on an int64 key that packs the value's
order-preserving bits above the row index (unique keys: no tie is left to chance), then
merged with the kept entries by a stable sort of their values (kept first: earlier in the
stream); windows are cut only for the batch entries that enter.

On a GPU every row is ranked (`torch.topk`; no host syncs). On the CPU only candidates are:
a batch row enters a concept only above its k-th kept value, and only at or above the k-th
value of an evenly strided sample of the batch (never above the batch's own k-th value); for
a sparse batch given its nonzero entries (`Entries`), the candidates are those and the first
k rows (a column without negative values ranks its largest nonzeros, then zeros in row
order, all of them within its first k rows). Either way the result is the exhaustive one.
Pure tensor math: no model, no I/O.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

_LOW = (1 << 32) - 1
SAMPLE_STEP = 4
"""Every SAMPLE_STEP-th row of a batch gives the lower bound of its k-th value per concept."""


def order_key(values: Tensor) -> Tensor:
    """float32 -> int32 whose signed order equals the float order (-0.0 counts as +0.0)."""
    bits = (values.float() + 0.0).contiguous().view(torch.int32)  # a copy: flipped in place below
    return bits.bitwise_xor_((bits >> 31).bitwise_and_(0x7FFFFFFF))  # negatives: all bits but the sign flipped


class Entries(NamedTuple):
    """The nonzero entries of a batch's activations `(N, n)`, in row-major order (zero elsewhere)."""

    rows: Tensor
    """`(M,)` int64."""
    cols: Tensor
    """`(M,)` int64."""
    values: Tensor
    """`(M,)` float32."""
    key32: Tensor
    """`(M,)` `order_key(values)`."""


def nonzero_entries(z: Tensor) -> Entries:
    """The nonzero entries of z `(N, n)` (one pass over z; -0.0 counts as zero)."""
    rows, cols = z.nonzero().unbind(1)
    values = z[rows, cols]
    return Entries(rows, cols, values, order_key(values))


def every_row(z: Tensor) -> bool:
    """Whether a batch is ranked over every row (on any accelerator: no host syncs) rather than
    through candidates (on the CPU, where reading a count back costs nothing)."""
    return z.device.type != "cpu"


def batch_top(z: Tensor, k: int, key32: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per column of z `(N, n)`: the k largest values `(n, k)` and their rows `(n, k)`, ties to
    the earlier row. `key32`: `order_key(z)` when the caller has it already."""
    rows = torch.arange(z.shape[0], device=z.device, dtype=torch.int64)
    key = (order_key(z) if key32 is None else key32).long()
    key.bitwise_left_shift_(32).bitwise_or_((_LOW - rows)[:, None])  # (N, n), unique per column
    top = torch.topk(key, min(k, z.shape[0]), dim=0).indices.T  # (n, k)
    return z.gather(0, top.T).T, top


def column_top(rows: Tensor, cols: Tensor, key32: Tensor, n: int, k: int) -> Tensor:
    """Entries `(M,)` of n columns -> each column's k best rows `(n, k)` by (value, earlier row),
    -1 where a column has fewer than k entries."""
    packed = key32.long().bitwise_left_shift_(32).bitwise_or_(_LOW - rows)  # unique within a column
    order = packed.argsort(descending=True)
    order = order[cols[order].argsort(stable=True)]  # column by column, best first
    col = cols[order]
    count = torch.bincount(col, minlength=n)
    rank = torch.arange(len(col), device=col.device) - (count.cumsum(0) - count)[col]
    keep = rank < k
    top = torch.full((n, k), -1, dtype=torch.long, device=rows.device)
    top[col[keep], rank[keep]] = rows[order[keep]]
    return top


class TopN:
    """The k largest activations of each of n concepts, with documents, positions and windows."""

    def __init__(self, n_concepts: int, k: int = 16, window: tuple[int, int] = (8, 4)) -> None:
        if k < 1 or n_concepts < 1 or min(window) < 0:
            raise ValueError(f"need n_concepts >= 1, k >= 1 and window sizes >= 0; got {n_concepts}, {k}, {window}")
        self.n, self.k, self.window = n_concepts, k, (int(window[0]), int(window[1]))
        self._values: Tensor | None = None  # None until the first batch sets every table up

    @property
    def values(self) -> Tensor:
        """`(n, k)` the largest activations of each concept, -inf in unused slots."""
        if self._values is None:
            raise RuntimeError("the top-N has seen no batch yet: it holds no values")
        return self._values

    @property
    def width(self) -> int:
        return self.window[0] + 1 + self.window[1]

    def _init(self, device: torch.device) -> None:
        n, k, w = self.n, self.k, self.width
        self._values = torch.full((n, k), -torch.inf, device=device)
        self.doc = torch.full((n, k), -1, dtype=torch.long, device=device)
        self.pos = torch.full((n, k), -1, dtype=torch.long, device=device)
        self.window_ids = torch.full((n, k, w), -1, dtype=torch.long, device=device)
        self.window_acts = torch.zeros(n, k, w, device=device)

    def update(self, z: Tensor, doc: Tensor, pos: Tensor, ids: Tensor, first_doc: int,
               key32: Tensor | None = None, entries: Entries | None = None) -> None:
        """z `(N, n)` rows in stream order with their doc/pos `(N,)` (doc counted in the source);
        ids `(B, T)` token ids of the batch (-1 = padding; batch row b is document first_doc + b).
        `key32`: `order_key(z)` when the caller has it; `entries`: z's nonzero entries when z is sparse."""
        if self._values is None:
            self._init(z.device)
        if z.shape[0] == 0:
            return
        if every_row(z):
            values, rows = batch_top(z, self.k, key32)  # (n, k') each
        else:
            values, rows = self._candidate_top(z, key32, entries)
        self._take(values, rows, z, doc, pos, ids, first_doc)

    def _candidate_top(self, z: Tensor, key32: Tensor | None, entries: Entries | None) -> tuple[Tensor, Tensor]:
        """`batch_top`'s k best per column where they can enter, through candidates (see the module
        docstring): values `(n, k')` and rows `(n, k')`, -inf and -1 past a column's candidates."""
        n, k = self.n, min(self.k, z.shape[0])
        beat = order_key(self.values[:, -1])  # (n,) the k-th kept value: a later row must exceed it
        if entries is not None and not bool((entries.key32 < 0).any()):
            later = entries.rows >= k
            rows = torch.cat([torch.arange(k, device=z.device).repeat_interleave(n), entries.rows[later]])
            cols = torch.cat([torch.arange(n, device=z.device).repeat(k), entries.cols[later]])
            keys = torch.cat([order_key(z[:k]).view(-1), entries.key32[later]])
            enters = keys > beat[cols]
            rows, cols, keys = rows[enters], cols[enters], keys[enters]
        else:
            key32 = order_key(z) if key32 is None else key32
            floor = beat + 1  # wraps to the least key when beat is the largest: more candidates, never fewer
            if bool((self.doc[:, -1] < 0).any()) and z.shape[0] >= SAMPLE_STEP * self.k:
                floor = torch.maximum(floor, key32[::SAMPLE_STEP].topk(self.k, dim=0).values[-1])
            rows, cols = (key32 >= floor).nonzero().unbind(1)
            keys = key32[rows, cols]
        top = column_top(rows, cols, keys, n, k)  # (n, k')
        values = z[top.clamp(min=0), torch.arange(n, device=z.device)[:, None]]
        return values.masked_fill(top < 0, -torch.inf), top

    def _windows(self, z: Tensor, rows: Tensor, concepts: Tensor, doc: Tensor, pos: Tensor, ids: Tensor,
                 first_doc: int) -> tuple[Tensor, Tensor]:
        """Token ids and this concept's activations `(..., W)` around batch rows `rows` (any shape)."""
        b, t = doc[rows] - first_doc, pos[rows]
        row_of = torch.full(ids.shape, -1, dtype=torch.long, device=z.device)  # (B, T): row of x, -1 if none
        row_of[doc - first_doc, pos] = torch.arange(z.shape[0], device=z.device)
        span = t[..., None] + torch.arange(-self.window[0], self.window[1] + 1, device=z.device)  # (..., W)
        inside = (span >= 0) & (span < ids.shape[1])
        span, b = span.clamp(0, ids.shape[1] - 1), b[..., None]
        window_ids = torch.where(inside, ids[b, span], -1)
        source = row_of[b, span]  # filtered tokens (the first position, outliers) show 0
        window_acts = torch.where(inside & (source >= 0), z[source.clamp(min=0), concepts[..., None]], 0.0)
        return window_ids, window_acts

    def _take(self, values: Tensor, rows: Tensor, z: Tensor, doc: Tensor, pos: Tensor, ids: Tensor,
              first_doc: int) -> None:
        """Keep the k best of the kept entries and a batch's best `values` / `rows` `(n, k')`."""
        k = self.k
        both = torch.cat([self.values, values], 1)
        order = torch.sort(both, dim=1, descending=True, stable=True).indices[:, :k]  # (n, k)
        fresh, kept = order >= k, order.clamp(max=k - 1)
        new_rows = rows.gather(1, (order - k).clamp(min=0)).clamp(min=0)  # (n, k) batch rows of fresh slots
        self._values = both.gather(1, order)
        self.doc = torch.where(fresh, doc[new_rows], self.doc.gather(1, kept))
        self.pos = torch.where(fresh, pos[new_rows], self.pos.gather(1, kept))
        wide = kept[..., None].expand(-1, -1, self.width)
        window_ids, window_acts = self.window_ids.gather(1, wide), self.window_acts.gather(1, wide)
        concepts = torch.arange(self.n, device=z.device)
        if every_row(z):  # every slot, then the fresh ones chosen: no host sync
            new_ids, new_acts = self._windows(z, new_rows, concepts[:, None], doc, pos, ids, first_doc)
            window_ids = torch.where(fresh[..., None], new_ids, window_ids)
            window_acts = torch.where(fresh[..., None], new_acts, window_acts)
        else:
            c, slot = fresh.nonzero(as_tuple=True)
            window_ids[c, slot], window_acts[c, slot] = self._windows(z, new_rows[c, slot], c, doc, pos, ids,
                                                                      first_doc)
        self.window_ids, self.window_acts = window_ids, window_acts

    def _merge(self, values: Tensor, doc: Tensor, pos: Tensor, window_ids: Tensor, window_acts: Tensor,
               lexicographic: bool = False) -> None:
        """Keep the k best of the kept entries and these (kept first: earlier in the stream)."""
        cat = [torch.cat(pair, 1) for pair in ((self.values, values), (self.doc, doc), (self.pos, pos),
                                                 (self.window_ids, window_ids), (self.window_acts, window_acts))]
        if lexicographic:  # entries of two shards interleave in the stream: order by (doc, pos) first
            first = torch.argsort(cat[1] * (1 << 32) + cat[2].clamp(min=0), dim=1, stable=True)
            cat = [c.gather(1, first if c.ndim == 2 else first[..., None].expand_as(c)) for c in cat]
        order = torch.sort(cat[0], dim=1, descending=True, stable=True).indices[:, :self.k]
        self._values, self.doc, self.pos = (c.gather(1, order) for c in cat[:3])
        wide = order[..., None].expand(-1, -1, self.width)
        self.window_ids, self.window_acts = cat[3].gather(1, wide), cat[4].gather(1, wide)

    def merge(self, other: TopN) -> None:
        """Absorb the entries of another shard (the same result as one stream over both)."""
        if (other.n, other.k, other.window) != (self.n, self.k, self.window):
            raise ValueError(f"cannot merge top-N of n={other.n}, k={other.k}, window={other.window} into "
                             f"n={self.n}, k={self.k}, window={self.window}")
        if other._values is None:
            return
        if self._values is None:
            self._init(other.values.device)
        unused = other.doc < 0  # -inf slots sort last either way; keep them last after the (doc, pos) sort
        doc = other.doc.masked_fill(unused, 1 << 30)
        self.doc = self.doc.masked_fill(self.doc < 0, 1 << 30)
        self._merge(other.values, doc, other.pos, other.window_ids, other.window_acts, lexicographic=True)
        self.doc = self.doc.masked_fill(self.doc == 1 << 30, -1)

    def state_dict(self) -> dict[str, Any]:
        tensors = {} if self._values is None else {
            "values": self.values, "doc": self.doc, "pos": self.pos,
            "window_ids": self.window_ids, "window_acts": self.window_acts}
        return {"n": self.n, "k": self.k, "window": list(self.window), **tensors}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["n"], state["k"], tuple(state["window"])) != (self.n, self.k, self.window):
            raise ValueError(f"top-N state for n={state['n']}, k={state['k']}, window={state['window']} does not "
                             f"fit n={self.n}, k={self.k}, window={self.window}")
        if "values" in state:
            for name in ("values", "doc", "pos", "window_ids", "window_acts"):
                setattr(self, "_values" if name == "values" else name, state[name].clone())
