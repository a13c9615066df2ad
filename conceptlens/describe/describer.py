"""ConceptDescriber: the description pass of one ConceptSet, as a streaming extractor.

    d = ConceptDescriber(cs, DescribeConfig(top_n=16, window=(8, 4)))
    lens.fit({cs.site: {"topk": d}}, held_out_texts)      # update(x, tokens=TokenRows) per batch
    description = d.description(tokenizer, unembedding)   # see conceptlens.describe.finish

Per concept it keeps the exact top-N activating tokens with their windows (`TopN`), a
histogram, firing counts, activation sums, the site's token norms, co-activation moments on
a strided subsample of each batch's rows and, when documents carry labels, per-document
activation sums for 1-D probes. Everything is a sum or a top-N, so `merge` of shards equals
one pass over both (top-N exactly; sums up to float64 rounding) and `state_dict` resumes
bit for bit. The update is tensor ops only: no host syncs.

Histogram bins are fixed in advance and shared by every concept, so no first pass and no
first batch decide them: signed quarter-octaves, edges +-2^(j/4) for j = -64..64 (|a| below
2^-16 or above 2^16 falls in the end bins), zeros counted apart. `finish` regroups each
concept's occupied range into `bins` display bins of whole fine bins (exact counts).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.describe.activations import concept_activations
from conceptlens.describe.topn import TopN

OCTAVE_STEPS = 4
HALF_BINS = 128  # fine bins per sign
FINE = 2 * HALF_BINS + 1  # ... plus one for zeros


@dataclass
class DescribeConfig:
    """What the description pass keeps per concept."""

    top_n: int = 16
    """Top activating tokens kept per concept."""
    window: tuple[int, int] = (8, 4)
    """Tokens kept left and right of each top token."""
    coact_rows: int = 512
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


def fine_bins(z: Tensor) -> Tensor:
    """`(N, n)` activations -> fine histogram bin `(N, n)` in [0, FINE): negatives, positives, zero last."""
    e = (OCTAVE_STEPS * torch.log2(z.abs())).floor().clamp(-HALF_BINS // 2, HALF_BINS // 2 - 1).long()
    e = e + HALF_BINS // 2  # 0 .. HALF_BINS - 1
    bins = torch.where(z > 0, HALF_BINS + e, HALF_BINS - 1 - e)
    return torch.where(z == 0, torch.full_like(bins, FINE - 1), bins)


def fine_edges() -> Tensor:
    """`(FINE,)` edges of the 2 * HALF_BINS signed bins (the zero bin has none): -2^16 .. 2^16."""
    j = torch.arange(-HALF_BINS // 2, HALF_BINS // 2 + 1, dtype=torch.float64)
    pos = torch.exp2(j / OCTAVE_STEPS)  # 2^-16 .. 2^16
    edges = torch.cat([-pos.flip(0), pos])  # (2 * (HALF_BINS + 1),); -2^-16 and 2^-16 around 0
    return torch.cat([edges[:HALF_BINS], torch.zeros(1, dtype=torch.float64), edges[HALF_BINS + 2:]])


class ConceptDescriber:
    """Streaming description of one ConceptSet; see the module docstring."""

    def __init__(self, concepts: ConceptSet, config: DescribeConfig | None = None, *, first_document: int = 0,
                 **kwargs: Any) -> None:
        self.concepts = concepts
        self.first_document = first_document
        """Index in the source of the first document this describer is fed (a shard's start, the
        documents a fit consumed): top-N documents are numbered in the source, so shards merge."""
        self.config = config or DescribeConfig(**kwargs)
        self.activations = concept_activations(concepts)
        self.n = len(concepts)
        self.top = TopN(self.n, self.config.top_n, self.config.window)
        self.sums: dict[str, Tensor] | None = None
        self.rows = self.documents = 0

    def _init(self, device: torch.device) -> None:
        n, f64 = self.n, torch.float64
        self.sums = {
            "act_sum": torch.zeros(n, dtype=f64, device=device),
            "fire_count": torch.zeros(n, dtype=torch.long, device=device),
            "hist": torch.zeros(n, FINE, dtype=torch.long, device=device),
            "norm_sum": torch.zeros((), dtype=f64, device=device),
            "sub_rows": torch.zeros((), dtype=torch.long, device=device),
            "sub_sum": torch.zeros(n, dtype=f64, device=device),
            "sub_outer": torch.zeros(n, n, dtype=f64, device=device),
        }
        if self.config.n_documents is not None:
            self.sums["doc_sum"] = torch.zeros(self.config.n_documents, n, dtype=f64, device=device)
            self.sums["doc_rows"] = torch.zeros(self.config.n_documents, dtype=torch.long, device=device)

    @torch.no_grad()
    def update(self, x: Tensor, *, tokens: Any) -> None:
        """x `(N, d)` kept rows; tokens: their `TokenRows` (documents, positions, batch token ids)."""
        if self.sums is None:
            self._init(x.device)
        s, n_rows = self.sums, x.shape[0]
        z = self.activations.encode(x)  # (N, n)
        fires = self.activations.fires(z, x)
        local, pos = tokens.doc.to(x.device), tokens.pos.to(x.device)  # documents of this stream
        ids = tokens.ids.to(x.device)
        grid = torch.zeros(*ids.shape, self.n, device=x.device)  # (B, T, n)
        grid[local - tokens.first_doc, pos] = z
        first = tokens.first_doc + self.first_document
        self.top.update(z, local + self.first_document, pos, ids, grid, first)
        s["act_sum"] += z.sum(0, dtype=torch.float64)
        s["fire_count"] += fires.sum(0)
        index = fine_bins(z) + FINE * torch.arange(self.n, device=x.device)
        s["hist"].view(-1).index_add_(0, index.view(-1), torch.ones(index.numel(), dtype=torch.long,
                                                                    device=x.device))
        s["norm_sum"] += x.norm(dim=1).sum(dtype=torch.float64)
        sub = (fires.float() if self.activations.sparse else z)[::max(1, -(-n_rows // self.config.coact_rows))]
        s["sub_rows"] += sub.shape[0]
        s["sub_sum"] += sub.sum(0, dtype=torch.float64)
        s["sub_outer"] += (sub.T @ sub).double()
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

    def state_dict(self) -> dict[str, Any]:
        cfg = asdict(self.config)
        cfg["window"] = list(cfg["window"])
        return {"config": cfg, "n": self.n, "rows": self.rows, "documents": self.documents,
                "sums": dict(self.sums or {}), "top": self.top.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()["config"]
        if state["config"] != mine or state["n"] != self.n:
            raise ValueError(f"description state for {state['n']} concepts, {state['config']} does not fit this "
                             f"describer ({self.n} concepts, {mine})")
        self.sums = {k: v.clone() for k, v in state["sums"].items()} or None
        self.rows, self.documents = state["rows"], state["documents"]
        self.top.load_state_dict(state["top"])

    def merge(self, other: ConceptDescriber | dict[str, Any]) -> None:
        """Absorb a shard described on other documents of the same source (same set, same config;
        each shard's `first_document` says where its documents start)."""
        if isinstance(other, dict):
            state, other = other, ConceptDescriber(self.concepts, self.config)  # documents numbered in the source
            other.load_state_dict(state)
        if other.n != self.n or other.config != self.config:
            raise ValueError(f"cannot merge a description of {other.n} concepts ({other.config}) into one of "
                             f"{self.n} ({self.config})")
        if self.config.n_documents is not None:
            raise ValueError("descriptions with labels keep per-document sums of their own stream; merge shards "
                             "described without labels")
        if other.sums is None:
            return
        if self.sums is None:
            self._init(other.sums["act_sum"].device)
        for key, value in other.sums.items():
            self.sums[key] += value.to(self.sums[key].device)
        self.top.merge(other.top)
        self.rows += other.rows
        self.documents += other.documents
