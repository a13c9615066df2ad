"""Streaming top-N equals sorting every activation, whatever the batching, after a resume and a merge."""

from __future__ import annotations

import pytest
import torch

from conceptlens.describe import topn
from conceptlens.describe.topn import TopN, batch_top, nonzero_entries, order_key

K, WINDOW = 5, (2, 1)


def stream(n_docs=30, length=9, n=6, seed=0, levels=None, sparse=None):
    """Random documents: ids (D, T) with ragged lengths (-1 pad) and activations (D, T, n);
    `sparse`: "positive" (mostly zeros, the rest > 0, like an SAE's) or "signed" (mostly zeros)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (n_docs,), generator=g)
    ids = torch.randint(0, 50, (n_docs, length), generator=g)
    real = torch.arange(length)[None] < lengths[:, None]
    ids = torch.where(real, ids, -1)
    z = torch.randn(n_docs, length, n, generator=g)
    if levels:  # many exact ties
        z = (z * levels).round() / levels
    if sparse:
        z = torch.where(torch.rand(z.shape, generator=g) < 0.15, z.abs() if sparse == "positive" else z, 0.0)
    return ids, z * real[..., None], real


def feed(top: TopN, ids, z, real, docs: range, sparse=False) -> None:
    """One batch of documents `docs` (drop position 0 like the fit's filter); `sparse`: with its nonzero entries."""
    b_ids, b_z, b_real = ids[docs.start:docs.stop], z[docs.start:docs.stop], real[docs.start:docs.stop]
    keep = b_real.clone()
    keep[:, 0] = False
    rows, pos = keep.nonzero(as_tuple=True)
    x = b_z[rows, pos]
    top.update(x, rows + docs.start, pos, b_ids, docs.start, entries=nonzero_entries(x) if sparse else None)


def reference(ids, z, real):
    """Sort all kept activations: value descending, then (document, position)."""
    keep = real.clone()
    keep[:, 0] = False
    doc, pos = keep.nonzero(as_tuple=True)  # stream order
    values = z[doc, pos]  # (N, n)
    out = []
    for c in range(z.shape[2]):
        order = torch.sort(values[:, c], descending=True, stable=True).indices[:K]
        out.append((values[order, c], doc[order], pos[order]))
    return out


def check(top: TopN, ids, z, real):
    for c, (values, doc, pos) in enumerate(reference(ids, z, real)):
        m = len(values)
        assert torch.equal(top.values[c, :m], values)
        assert torch.equal(top.doc[c, :m], doc) and torch.equal(top.pos[c, :m], pos)
        assert (top.values[c, m:] == -torch.inf).all() and (top.doc[c, m:] == -1).all()
        for j in range(m):  # windows: ids and this concept's activations around the token
            d, p = int(doc[j]), int(pos[j])
            for w, off in enumerate(range(-WINDOW[0], WINDOW[1] + 1)):
                q = p + off
                inside = 0 <= q < ids.shape[1]
                assert top.window_ids[c, j, w] == (ids[d, q] if inside else -1)
                assert top.window_acts[c, j, w] == (z[d, q, c] if inside and q > 0 else 0.0)  # q = 0: filtered


@pytest.mark.parametrize("levels", [None, 2])
@pytest.mark.parametrize("batch", [1, 4, 7, 30])
def test_streaming_top_n_equals_sorting_everything(batch, levels):
    ids, z, real = stream(levels=levels)
    top = TopN(z.shape[2], K, WINDOW)
    for start in range(0, len(ids), batch):
        feed(top, ids, z, real, range(start, min(start + batch, len(ids))))
    check(top, ids, z, real)


@pytest.mark.parametrize("levels", [None, 2])
def test_resume_and_merge_give_the_same_top_n(levels):
    ids, z, real = stream(levels=levels, seed=1)
    first = TopN(z.shape[2], K, WINDOW)
    for start in range(0, 12, 5):
        feed(first, ids, z, real, range(start, min(start + 5, 12)))
    resumed = TopN(z.shape[2], K, WINDOW)
    resumed.load_state_dict(first.state_dict())
    for start in range(12, 30, 3):
        feed(resumed, ids, z, real, range(start, min(start + 3, 30)))
    check(resumed, ids, z, real)
    # two shards of interleaved documents, merged either way round
    a, b = TopN(z.shape[2], K, WINDOW), TopN(z.shape[2], K, WINDOW)
    for start in range(0, 30, 2):
        feed(a if start % 4 == 0 else b, ids, z, real, range(start, start + 2))
    b_copy = TopN(z.shape[2], K, WINDOW)
    b_copy.load_state_dict(b.state_dict())
    a.merge(b)
    check(a, ids, z, real)
    empty = TopN(z.shape[2], K, WINDOW)
    empty.merge(b_copy)
    b_copy.merge(TopN(z.shape[2], K, WINDOW))  # merging an empty shard changes nothing
    assert torch.equal(empty.values, b_copy.values) and torch.equal(empty.doc, b_copy.doc)


@pytest.mark.parametrize("every_row", [False, True])
@pytest.mark.parametrize("sparse", ["positive", "signed"])
@pytest.mark.parametrize("batch", [1, 4, 30])
def test_sparse_batches_and_both_ranking_paths_equal_sorting_everything(batch, sparse, every_row, monkeypatch):
    """Candidates from nonzero entries (the CPU path; signed values fall back to thresholds) and
    every row ranked (the GPU path, here on the CPU) give the exhaustive top-N, windows included."""
    monkeypatch.setattr(topn, "every_row", lambda z: every_row)
    ids, z, real = stream(n_docs=40, n=9, levels=2, sparse=sparse, seed=3)  # few nonzeros, many ties
    top = TopN(z.shape[2], K, WINDOW)
    for start in range(0, len(ids), batch):
        feed(top, ids, z, real, range(start, min(start + batch, len(ids))), sparse=True)
    check(top, ids, z, real)


def test_candidates_hold_a_batchs_best_beyond_the_sampled_rows():
    """A batch (>= 4k rows) whose best rows are not sampled, or tie with the sample's k-th value."""
    z = torch.zeros(40, 3)
    z[1::4, 0] = torch.arange(10, 0, -1).float()  # column 0: its best rows are off the sample (rows 0, 4, ...)
    z[::4, 1] = -1.0
    z[35, 1] = 5.0  # column 1: one large value, the rest tied at 0 (rows after the sampled -1s) and -1
    z[:, 2] = 0.5  # column 2: every value equals the sample's k-th
    top = TopN(3, 5, (1, 1))
    top.update(z, torch.zeros(40, dtype=torch.long), torch.arange(40), torch.arange(40)[None], 0)
    assert top.pos[0].tolist() == [1, 5, 9, 13, 17] and top.values[0].tolist() == [10, 9, 8, 7, 6]
    assert top.pos[1].tolist() == [35, 1, 2, 3, 5] and top.values[1].tolist() == [5, 0, 0, 0, 0]
    assert top.pos[2].tolist() == [0, 1, 2, 3, 4] and top.values[2].tolist() == [0.5] * 5


def test_sparse_candidates_reach_zeros_after_negative_rows():
    """Negative nonzeros ahead of a column's zeros push its best zeros past the first k rows."""
    z = torch.zeros(10, 1)
    z[:6] = -1.0
    z[9] = 2.0
    top = TopN(1, 3, (0, 0))
    top.update(z, torch.zeros(10, dtype=torch.long), torch.arange(10), torch.arange(10)[None], 0,
               entries=nonzero_entries(z))
    assert top.pos[0].tolist() == [9, 6, 7] and top.values[0].tolist() == [2, 0, 0]


def test_order_key_sorts_like_the_floats():
    x = torch.tensor([-3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, 7.25, -torch.inf, torch.inf])
    assert torch.equal(torch.argsort(order_key(x), stable=True), torch.argsort(x, stable=True))
    values, rows = batch_top(torch.tensor([[1.0], [3.0], [3.0], [2.0]]), 3)
    assert values.tolist() == [[3.0, 3.0, 2.0]] and rows.tolist() == [[1, 2, 3]]  # ties: earlier row first


def test_mismatched_merge_is_refused():
    with pytest.raises(ValueError, match="cannot merge top-N of n=3"):
        TopN(4, 2).merge(TopN(3, 2))
