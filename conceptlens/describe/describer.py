"""ConceptDescriber: the description pass of one ConceptSet, as a streaming extractor.

    d = ConceptDescriber(cs, DescribeConfig(top_n=16, window=(8, 4)))
    lens.fit({cs.site: {"topk": d}}, held_out_texts)      # update(x, tokens=TokenRows) per batch
    description = d.description(tokenizer, unembedding)   # see conceptlens.describe.finish

Per concept it keeps the exact top-N activating tokens with their windows (`TopN`), a
histogram, firing counts, activation sums, the site's token norms, co-activation moments on
a strided subsample of each batch's rows and, when documents carry labels, per-document
activation sums for 1-D probes. Everything is a sum or a top-N, so `merge` of shards equals
one pass over both (top-N exactly; sums up to float64 rounding) and `state_dict` resumes
bit for bit. On a GPU the update is tensor ops only: no host syncs. On the CPU, where a sync
costs nothing, a sparse (SAE) set's batch is counted from its nonzero entries (one pass over
the activations finds them; counts, histogram and co-firing then cost per nonzero, not per
entry) and the top-N ranks only candidate rows (`topn.py`): the same sums and top-N, bit for bit.

Histogram bins are fixed in advance and shared by every concept, so no first pass and no
first batch decide them: the float's own exponent and two mantissa bits (the order key
shifted right by 21), i.e. four linear steps per octave, 2^e * (1, 1.25, 1.5, 1.75), on each
sign, for |a| in [2^-16, 2^16) (smaller and larger values fall in the innermost / outermost
bins); exact zeros are counted apart. `finish` regroups each concept's occupied range into
`bins` display bins of whole fine bins (exact counts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from conceptlens.concepts.base import ExtractorBase
from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.describe.activations import concept_activations
from conceptlens.describe.norms import NormWatch
from conceptlens.describe.topn import Entries, TopN, every_row, nonzero_entries, order_key

HALF_BINS = 128  # fine bins per sign: 32 octaves x 4
FINE = 2 * HALF_BINS
COARSE = 2048  # values of an order key's top 11 bits (key >> 21): each falls in one fine bin
_LOWEST = (127 - 16) * 4  # order key >> 21 of 2^-16: the first positive fine bin


@dataclass
class DescribeConfig:
    """What the description pass keeps per concept."""

    top_n: int = 16
    """Top activating tokens kept per concept."""
    window: tuple[int, int] = (8, 4)
    """Tokens kept left and right of each top token."""
    coact_rows: int = 128
    """Rows of each batch (evenly strided) that feed the co-activation moments (n x n per row)."""
    n_documents: int | None = None
    """Documents of the source that carry labels (sizes the per-document sums); None: no labels."""

    def __post_init__(self) -> None:
        self.window = (int(self.window[0]), int(self.window[1]))
        if self.top_n < 1 or self.coact_rows < 1 or min(self.window) < 0:
            raise ValueError(f"top_n and coact_rows must be >= 1 and window sizes >= 0; got top_n={self.top_n}, "
                             f"coact_rows={self.coact_rows}, window={self.window}")
        if self.n_documents is not None and self.n_documents < 1:
            raise ValueError(f"n_documents must be a positive integer or None; got {self.n_documents}")


def fine_bins(key32: Tensor) -> Tensor:
    """`order_key` of activations `(N, n)` -> fine bin in [0, FINE) `(N, n)` int32: negatives
    (most negative first) then positives; zeros land in bin HALF_BINS (subtract them)."""
    q = key32 >> 21  # sign, exponent, two mantissa bits; monotonic in the value
    pos = q.clamp(_LOWEST, _LOWEST + HALF_BINS - 1) - (_LOWEST - HALF_BINS)
    neg = q.clamp(-_LOWEST - HALF_BINS, -_LOWEST - 1) + (_LOWEST + HALF_BINS)
    return torch.where(q >= 0, pos, neg)


def fine_edges() -> Tensor:
    """`(FINE + 1,)` edges of the fine bins: -2^16 .. -2^-16, 0, 2^-16 .. 2^16 (float64)."""
    p = torch.arange(_LOWEST, _LOWEST + HALF_BINS + 1, dtype=torch.float64)
    pos = torch.exp2(torch.floor(p / 4) - 127) * (1 + (p % 4) / 4)  # 2^-16 .. 2^16, 129 values
    return torch.cat([-pos.flip(0)[:HALF_BINS], torch.zeros(1, dtype=torch.float64), pos[1:]])


class DescribeStats(NamedTuple):
    rows: int
    """Tokens described."""
    documents: int
    """Documents of this stream seen."""


class ConceptDescriber(ExtractorBase):
    """Streaming description of one ConceptSet; see the module docstring. An extractor in the
    protocol's sense (update / flush / state_dict / load_state_dict / merge / stats), without
    concepts of its own: the fit reports its stats and saves no ConceptSet for it."""

    Config = DescribeConfig
    method = "describe"

    def __init__(self, concepts: ConceptSet, config: DescribeConfig | None = None, *, first_document: int = 0,
                 watch_norms: bool = False, **kwargs: Any) -> None:
        self.concepts = concepts
        self.first_document = first_document
        """Index in the source of the first document this describer is fed (a shard's start, the
        documents a fit consumed): top-N documents are numbered in the source, so shards merge."""
        self.config = config or DescribeConfig(**kwargs)
        self.activations = concept_activations(concepts)
        self.n = len(concepts)
        self.top = TopN(self.n, self.config.top_n, self.config.window)
        self.norms = NormWatch(self.config.window) if watch_norms else None
        """The site's largest-norm tokens and their variance share (one describer per site keeps it)."""
        self.sums: dict[str, Tensor] | None = None
        self.rows = self.documents = 0

    def _init(self, device: torch.device) -> dict[str, Tensor]:
        """Zero sums on `device`, kept as `self.sums` and returned."""
        n, f64 = self.n, torch.float64
        sums = {
            "act_sum": torch.zeros(n, dtype=f64, device=device),
            "fire_count": torch.zeros(n, dtype=torch.long, device=device),
            "assign_count": torch.zeros(n, dtype=torch.long, device=device),
            "hist": torch.zeros(n, FINE, dtype=torch.long, device=device),
            "zeros": torch.zeros(n, dtype=torch.long, device=device),
            "norm_sum": torch.zeros((), dtype=f64, device=device),
            "sub_rows": torch.zeros((), dtype=torch.long, device=device),
            "sub_sum": torch.zeros(n, dtype=f64, device=device),
            "sub_outer": torch.zeros(n, n, device=device),  # float32: addmm in place, no (n, n) copy per batch
        }
        if self.config.n_documents is not None:
            sums["doc_sum"] = torch.zeros(self.config.n_documents, n, dtype=f64, device=device)
            sums["doc_rows"] = torch.zeros(self.config.n_documents, dtype=torch.long, device=device)
        self.sums = sums
        return sums

    @torch.no_grad()
    def update(self, x: Tensor, *, tokens: Any) -> None:
        """x `(N, d)` kept rows; tokens: their `TokenRows` (documents, positions, batch token ids)."""
        s = self.sums if self.sums is not None else self._init(x.device)
        n_rows = x.shape[0]
        z = self.activations.encode(x).contiguous()  # (N, n)
        local, pos = tokens.doc.to(x.device), tokens.pos.to(x.device)  # documents of this stream
        ids = tokens.ids.to(x.device)
        entries = nonzero_entries(z) if self.activations.sparse and not every_row(z) else None
        key32 = order_key(z) if entries is None else None  # shared by the top-N and the histogram
        self.top.update(z, local + self.first_document, pos, ids, tokens.first_doc + self.first_document, key32,
                        entries)
        if self.norms is not None:
            self.norms.update(x, local + self.first_document, pos, ids, tokens.first_doc + self.first_document)
        s["act_sum"] += z.sum(0)  # float32 within a batch, float64 across batches
        assigned = self.activations.assign_count(z, x)
        if assigned is not None:
            s["assign_count"] += assigned
        s["norm_sum"] += x.norm(dim=1).sum(dtype=torch.float64)
        step = max(1, -(-n_rows // self.config.coact_rows))  # co-activation on evenly strided rows
        if key32 is not None:  # dense: the order key was built (exactly when entries were not)
            s["fire_count"] += self.activations.fire_count(z, x)
            s["zeros"] += torch.count_nonzero(key32 == 0, dim=0)
            _count_bins(s["hist"], key32)
            sub = z[::step]
            sub = (sub > 0).float() if self.activations.sparse else sub
            s["sub_rows"] += sub.shape[0]
            s["sub_sum"] += sub.sum(0)
            _add_outer(s["sub_outer"], sub, self.activations.sparse)
        elif entries is not None:
            _count_entries(s, entries, n_rows, step)
        if "doc_sum" in s:
            last = tokens.first_doc + ids.shape[0]
            if last > self.config.n_documents:
                raise ValueError(f"document {last - 1} has no label: the labels cover {self.config.n_documents} "
                                 "documents of the source")
            s["doc_sum"].index_add_(0, local, z.double())
            s["doc_rows"].index_add_(0, local, torch.ones_like(local))
        self.rows += n_rows
        self.documents = max(self.documents, tokens.first_doc + ids.shape[0])  # of this stream

    def flush(self) -> None:
        """Nothing is held back."""

    def stats(self) -> DescribeStats:
        return DescribeStats(self.rows, self.documents)

    def state_dict(self) -> dict[str, Any]:
        return {"class": type(self).__name__, "config": self.config_dict(), "n": self.n, "rows": self.rows,
                "documents": self.documents, "sums": dict(self.sums or {}), "top": self.top.state_dict(),
                "norms": None if self.norms is None else self.norms.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        if state["n"] != self.n:
            raise ValueError(f"description state for {state['n']} concepts does not fit this set of {self.n}")
        self.sums = {k: v.clone() for k, v in state["sums"].items()} or None
        self.rows, self.documents = state["rows"], state["documents"]
        self.top.load_state_dict(state["top"])
        if self.norms is not None and state.get("norms") is not None:
            self.norms.load_state_dict(state["norms"])

    def merge(self, other: ConceptDescriber | dict[str, Any]) -> None:  # a dict needs this set to rebuild
        """Absorb a shard described on other documents of the same source (same set, same config;
        each shard's `first_document` says where its documents start)."""
        if isinstance(other, dict):
            state, other = other, ConceptDescriber(self.concepts, self.config, watch_norms=self.norms is not None)
            other.load_state_dict(state)
        super().merge(other)

    def _merge(self, other: ConceptDescriber) -> None:
        if other.n != self.n or other.config != self.config:
            raise ValueError(f"cannot merge a description of {other.n} concepts ({other.config}) into one of "
                             f"{self.n} ({self.config})")
        if self.config.n_documents is not None:
            raise ValueError("descriptions with labels keep per-document sums of their own stream; merge shards "
                             "described without labels")
        if other.sums is None:
            return
        mine = self.sums if self.sums is not None else self._init(other.sums["act_sum"].device)
        for key, value in other.sums.items():
            mine[key] += value.to(mine[key].device)
        self.top.merge(other.top)
        if self.norms is not None and other.norms is not None:
            self.norms.merge(other.norms)
        self.rows += other.rows
        self.documents += other.documents


def _add_outer(outer: Tensor, sub: Tensor, sparse: bool) -> None:
    """outer `(n, n)` += sub.T @ sub for sub `(R, n)`. A sparse set's 0/1 firing rows have few ones:
    on CPU a sparse product over them, the same exact counts at a fraction of the dense product's
    R n^2 (on a GPU the dense product, with no size read back to the host)."""
    if sparse and not sub.is_cuda:
        outer.addmm_(sub.to_sparse().t(), sub)
    else:
        outer.addmm_(sub.T, sub)


def _count_entries(sums: dict[str, Tensor], entries: Entries, n_rows: int, step: int) -> None:
    """The dense path's firing counts, zeros, histogram and co-firing moments of a sparse batch
    `(n_rows, n)` from its nonzero entries alone (equal counts: zeros fall in fine bin HALF_BINS)."""
    rows, cols, values, key32 = entries
    n = sums["zeros"].shape[0]
    sums["fire_count"] += torch.bincount(cols[values > 0], minlength=n)
    zeros = n_rows - torch.bincount(cols, minlength=n)
    sums["zeros"] += zeros
    sums["hist"].view(-1).index_add_(0, cols * FINE + fine_bins(key32), torch.ones_like(cols))
    sums["hist"][:, HALF_BINS] += zeros
    sampled = (rows % step == 0) & (values > 0)  # the rows z[::step], as 0/1
    sums["sub_rows"] += -(-n_rows // step)
    sums["sub_sum"] += torch.bincount(cols[sampled], minlength=n)
    _add_cofiring(sums["sub_outer"], rows[sampled], cols[sampled])


def _add_cofiring(outer: Tensor, rows: Tensor, cols: Tensor) -> None:
    """outer `(n, n)` += S.T @ S for the 0/1 matrix S with ones at (rows, cols) (row-major order):
    +1 per pair of ones in a row, as the sparse product of `_add_outer` adds them."""
    per_row = torch.bincount(rows)
    count = per_row[rows]  # (E,) ones in each one's row
    first = (per_row.cumsum(0) - per_row)[rows]  # (E,) the row's first one
    left = torch.repeat_interleave(torch.arange(len(rows), device=rows.device), count)  # (P,) P = sum of count^2
    start = torch.repeat_interleave(count.cumsum(0) - count, count)
    right = first[left] + torch.arange(len(left), device=rows.device) - start
    n = outer.shape[0]
    outer.view(-1).index_add_(0, cols[left] * n + cols[right], outer.new_ones(1).expand(len(left)))


def _count_bins(hist: Tensor, key32: Tensor) -> None:
    """hist `(n, FINE)` += the fine-bin counts of `order_key`s `(N, n)` per column. The fine bin is a
    function of the key's top 11 bits alone, so the values are counted once into those 2048 coarse
    bins (one shift, one multiply-add and one bincount over the keys; coarse bin major, so a column's
    zeros, most of a sparse set's values, share one cache line with its neighbours'), and the small
    `(2048, n)` table is folded onto the fine bins by `fine_bins` of each coarse bin (bincount on CPU;
    index_add on a GPU: no sync)."""
    n = hist.shape[0]
    wide = torch.int32 if n * COARSE < 2**31 else torch.int64
    column = COARSE // 2 * n + torch.arange(n, device=key32.device, dtype=wide)  # (n,)
    flat = torch.add(column, (key32 >> 21).to(wide), alpha=n).view(-1)  # (N n,) coarse bin * n + column
    if flat.is_cuda:
        coarse = torch.zeros(n * COARSE, dtype=torch.long, device=flat.device)
        coarse.index_add_(0, flat, torch.ones(1, dtype=torch.long, device=flat.device).expand(flat.numel()))
    else:
        coarse = torch.bincount(flat, minlength=n * COARSE)
    fold = fine_bins(torch.arange(-COARSE // 2, COARSE // 2, dtype=torch.int32, device=hist.device) << 21)
    hist.T.index_add_(0, fold.long(), coarse.view(COARSE, n))
