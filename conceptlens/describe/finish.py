"""From a ConceptDescriber's sums to a Description: histograms, neighbours, tokens, probes.

    description = finish(describer, name="topk", tokenizer=tok, unembedding=W_U, labels=y)

Pure tensor math on the describer's state, plus decoding token ids with the tokenizer.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import Tensor

from conceptlens.describe.describer import FINE, HALF_BINS, ConceptDescriber, fine_edges
from conceptlens.describe.logits import Unembedding, logit_tokens, row_extremes  # noqa: F401 (finish's API)
from conceptlens.describe.texts import REPLACEMENT, byte_text, chips, decoder, whole  # noqa: F401 (finish's API)


def display_histogram(fine: Tensor, zeros: Tensor, bins: int) -> tuple[Tensor, Tensor]:
    """Fine counts `(n, FINE)` (zeros, counted apart in `(n,)`, inside bin HALF_BINS) -> per-concept
    edges `(n, bins + 1)` and counts `(n, bins)`: each concept's occupied range of fine bins cut
    into `bins` groups of whole fine bins, zeros left out."""
    signed = fine.clone()
    signed[:, HALF_BINS] -= zeros
    occupied = signed > 0
    cols = torch.arange(FINE).expand_as(signed)
    lo = torch.where(occupied, cols, FINE).min(1).values
    hi = torch.where(occupied, cols, -1).max(1).values
    empty = hi < 0
    lo, hi = torch.where(empty, 0, lo), torch.where(empty, 0, hi)
    group = torch.div(hi - lo + bins, bins, rounding_mode="floor")  # ceil((hi - lo + 1) / bins)
    cut = torch.minimum(lo[:, None] + group[:, None] * torch.arange(bins + 1), hi[:, None] + 1)  # (n, bins + 1)
    cum = torch.nn.functional.pad(signed.cumsum(1), (1, 0))
    counts = cum.gather(1, cut[:, 1:]) - cum.gather(1, cut[:, :-1])
    edges = fine_edges()[cut].float()
    return torch.where(empty[:, None], 0.0, edges), counts


def nearest(scores: Tensor, m: int, first: int = 0) -> tuple[Tensor, Tensor]:
    """Top-m other concepts per row of a square score matrix (the diagonal left out); `first`: the
    concept of the first row when `scores` holds rows first, first + 1, ... of it."""
    own = scores.float()  # a copy unless it is float32 already
    scores = own.clone() if own is scores else own
    rows = torch.arange(len(scores))
    scores[rows, rows + first] = -math.inf
    m = min(m, scores.shape[1] - 1)
    if m < 1:
        return torch.zeros(len(scores), 0, dtype=torch.long), torch.zeros(len(scores), 0)
    top = scores.topk(m, dim=1)
    return top.indices, top.values


def nearest_direction(unit: Tensor, m: int, chunk: int = 512) -> tuple[Tensor, Tensor]:
    """`nearest(unit @ unit.T, m)` for unit directions `(n, d)`, a block of rows at a time (no (n, n)
    product and copy: 2 x 4 GB at 32k concepts)."""
    parts = [nearest(rows @ unit.T, m, i) for i, rows in zip(range(0, len(unit), chunk), unit.split(chunk))]
    return torch.cat([ids for ids, _ in parts]), torch.cat([values for _, values in parts])


def nearest_coactive(sums: dict[str, Tensor], sparse: bool, m: int, chunk: int = 512) -> tuple[Tensor, Tensor]:
    """`nearest(coactivation(sums, sparse), m)`, a block of rows at a time (no (n, n) float64 copies)."""
    n = len(sums["sub_sum"])
    parts = [nearest(coactivation(sums, sparse, slice(i, i + chunk)), m, i) for i in range(0, n, chunk)]
    return torch.cat([ids for ids, _ in parts]), torch.cat([values for _, values in parts])


def coactivation(sums: dict[str, Tensor], sparse: bool, rows: slice = slice(None)) -> Tensor:
    """Jaccard of firing (sparse sets) or Pearson correlation of activations (dense sets), `(n, n)`
    (its `rows` only when given)."""
    outer, total, seen = sums["sub_outer"].cpu(), sums["sub_sum"].cpu(), float(sums["sub_rows"])
    diagonal, part = outer.diagonal().double(), outer[rows].to(torch.float64, copy=True)  # worked on in place
    if sparse:
        union = (diagonal[rows, None] + diagonal[None, :]).sub_(part)
        empty = ~(union > 0)
        return part.div_(union.clamp_(min=1e-12)).masked_fill_(empty, 0.0)
    mean = total / max(seen, 1.0)
    cov = part.div_(max(seen, 1.0)).sub_(mean[rows, None] * mean[None, :])
    std = (diagonal / max(seen, 1.0) - mean * mean).clamp(min=0).sqrt()
    denom = std[rows, None] * std[None, :]
    empty = ~(denom > 0)
    return cov.div_(denom.clamp_(min=1e-300)).masked_fill_(empty, 0.0)


def map_xy(directions: Tensor) -> Tensor:
    """2-D PCA coordinates `(n, 2)` of the unit directions (the top two eigenvectors of the smaller
    Gram matrix, computed alone; each axis's sign set so that its largest coordinate is positive)."""
    from scipy.linalg import eigh
    from threadpoolctl import threadpool_limits

    unit = torch.nn.functional.normalize(directions.double(), dim=1)
    centred = unit - unit.mean(0)
    xy = torch.zeros(len(unit), 2, dtype=torch.float64)
    if len(unit) < 2:
        return xy.float()
    small = centred.shape[1] <= centred.shape[0]
    gram = (centred.T @ centred if small else centred @ centred.T).numpy()
    top = max(len(gram) - 2, 0)
    with threadpool_limits(1, user_api="blas"):  # a small eigh: threaded BLAS only waits (100x on a busy machine)
        pairs = eigh(gram, subset_by_index=[top, len(gram) - 1])
    values, vectors = (torch.from_numpy(a).flip(-1) for a in pairs)
    scores = centred @ vectors if small else vectors * values.clamp(min=0).sqrt()
    scores = scores * torch.where(scores.gather(0, scores.abs().argmax(0, keepdim=True)) < 0, -1.0, 1.0)
    xy[:, : scores.shape[1]] = scores
    return xy.float()


def class_probes(doc_sum: Tensor, doc_rows: Tensor, labels: Sequence[int], n_classes: int) -> tuple[Tensor, Tensor]:
    """Per concept and class, the test log-loss of a 1-D logistic probe on document-mean
    activations, standardised by the train documents (as `metrics.quality.standardised_probe_loss`): `(n, C)`,
    and the base-rate entropy per class `(C,)` (nats). Described documents alternate train / test
    in their order (even: train, odd: test)."""
    from conceptlens.metrics.quality import _chunk, fit_logistic_1d, logistic_log_loss, standardised_by

    seen = (doc_rows > 0).nonzero().squeeze(1).cpu()
    means = (doc_sum[seen] / doc_rows[seen, None]).cpu()
    y = torch.as_tensor([labels[i] for i in seen.tolist()])
    train, test = torch.arange(len(seen)) % 2 == 0, torch.arange(len(seen)) % 2 == 1
    means[train], means[test] = standardised_by(means[train], means[test])
    loss = torch.full((means.shape[1], n_classes), math.nan)
    entropy = torch.full((n_classes,), math.nan)
    for c in range(n_classes):
        y_tr, y_te = (y[train] == c).double(), (y[test] == c).double()
        if not len(y_te) or y_tr.min() == y_tr.max():
            continue  # a class absent (or alone) in the train half cannot be probed
        rate = float(y_te.mean())
        entropy[c] = 0.0 if rate in (0.0, 1.0) else -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
        for cols in torch.arange(means.shape[1]).split(_chunk(int(train.sum()))):
            w, b = fit_logistic_1d(means[train][:, cols], y_tr)
            loss[cols, c] = logistic_log_loss(means[test][:, cols], y_te, w, b).float()
    return loss, entropy


def used_slots(describer: ConceptDescriber) -> tuple[Tensor, Tensor, Tensor]:
    """Top values, documents and positions `(n, k)` with unused slots -inf / -1; for sparse
    (SAE) sets a zero activation is no context either."""
    top = describer.top
    values, doc, pos = top.values.cpu().float(), top.doc.cpu(), top.pos.cpu()
    unused = doc < 0
    if describer.activations.sparse:
        unused |= values <= 0
    return values.masked_fill(unused, -math.inf), doc.masked_fill(unused, -1), pos.masked_fill(unused, -1)


def decode_contexts(describer: ConceptDescriber, tokenizer: Any,
                    known: dict[int, str] | None = None) -> list[dict[str, Any]]:
    """contexts.jsonl lines: each concept's top windows, trimmed to their document, tokens decoded,
    activations to 5 significant digits. Only the used slots (those before a concept's first unused
    one) are read back and decoded; a window's chips are grouped only when one of its tokens is part
    of a character. `known`: token texts decoded already (see `decoder`)."""
    top = describer.top
    values, doc, pos = used_slots(describer)
    used = (doc >= 0).int().cumprod(1).bool()  # (n, k)
    ids = top.window_ids.cpu()[used]  # (M, W) the used windows, concept by concept
    acts = top.window_acts.cpu()[used].double()
    magnitude = torch.floor(torch.log10(acts.abs().clamp(min=1e-30)))
    scale = torch.pow(10.0, 4 - magnitude)
    acts = torch.where(acts == 0, 0.0, torch.round(acts * scale) / scale)
    present = ids[ids >= 0]
    vocab = decoder(tokenizer, torch.bincount(present).nonzero().squeeze(1).tolist() if len(present) else [], known)
    broken = {t for t, text in vocab.items() if REPLACEMENT in text}
    left = top.window[0]
    all_ids, all_acts = ids.tolist(), acts.tolist()
    all_values, all_doc, all_pos = values[used].tolist(), doc[used].tolist(), pos[used].tolist()

    def context(r: int) -> dict[str, Any]:
        row = all_ids[r]
        if min(row) >= 0:  # a window inside its document (most): every token kept
            kept, kept_acts, center = row, all_acts[r], left
        else:
            kept = [t for t in row if t >= 0]
            kept_acts = [a for a, t in zip(all_acts[r], row) if t >= 0]
            center = left - next(i for i, t in enumerate(row) if t >= 0)
        if broken and not broken.isdisjoint(kept):
            tokens, kept_acts, center = chips(tokenizer, kept, kept_acts, center, vocab)
        else:
            tokens = [vocab[t] for t in kept]
        return {"value": all_values[r], "doc": all_doc[r], "pos": all_pos[r], "center": center, "tokens": tokens,
                "acts": kept_acts}

    lines, start = [], 0
    for c, m in enumerate(used.sum(1).tolist()):
        contexts = [context(r) for r in range(start, start + m)]
        start += m
        lines.append({"concept": c, "contexts": contexts})
    return lines
