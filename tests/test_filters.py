"""RowFilter: the same masks and counts as a plain reference, with no per-batch host reads."""

from __future__ import annotations

import torch

from conceptlens.filters import FilterConfig, RowFilter


def reference(batches, config: FilterConfig):
    """Straightforward list-based filter: finite, not position 0, norm <= ratio * running median."""
    history: list[float] = []
    counts = dict(seen=0, kept=0, nonfinite=0, first_position=0, norm_outlier=0)
    masks = []
    for x, pos in batches:
        keep = torch.isfinite(x).all(1)
        counts["nonfinite"] += int((~keep).sum())
        first = keep & (pos == 0)
        counts["first_position"] += int(first.sum())
        keep &= ~first
        norms = x.norm(dim=1)
        pool = torch.tensor(history + norms[keep].tolist())
        if pool.numel():
            out = keep & (norms > config.max_norm_ratio * pool.median())
            counts["norm_outlier"] += int(out.sum())
            keep &= ~out
        history = (history + norms[keep].tolist())[-config.window:]
        counts["seen"] += x.shape[0]
        counts["kept"] += int(keep.sum())
        masks.append(keep)
    return masks, counts, torch.tensor(history)


def batches(seed=0, n=12):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        rows = int(torch.randint(1, 40, (1,), generator=g))
        x = torch.randn(rows, 6, generator=g) * (1 + torch.rand(rows, 1, generator=g))
        x[torch.rand(rows, generator=g) < 0.1] *= 50  # norm outliers
        x[torch.rand(rows, generator=g) < 0.05, 2] = float("nan")
        out.append((x, torch.randint(0, 5, (rows,), generator=g)))
    return out


def test_masks_counts_and_history_match_the_reference():
    config = FilterConfig(max_norm_ratio=3.0, window=50)  # a small window, so the ring wraps
    rows = RowFilter(config)
    data = batches()
    masks = [rows("s", x, pos) for x, pos in data]
    ref_masks, ref_counts, ref_history = reference(data, config)
    for got, want in zip(masks, ref_masks):
        assert torch.equal(got, want)
    assert rows.counts["s"] == ref_counts and ref_counts["norm_outlier"] > 0 and ref_counts["nonfinite"] > 0
    torch.testing.assert_close(rows.norms["s"], ref_history)


def test_resume_from_state_continues_identically():
    config = FilterConfig(max_norm_ratio=3.0, window=50)
    data = batches(seed=1)
    whole, half = RowFilter(config), RowFilter(config)
    for x, pos in data[:6]:
        whole("s", x, pos), half("s", x, pos)
    resumed = RowFilter(config)
    resumed.load_state_dict(half.state_dict())
    for x, pos in data[6:]:
        assert torch.equal(whole("s", x, pos), resumed("s", x, pos))
    assert whole.counts == resumed.counts
    torch.testing.assert_close(whole.norms["s"], resumed.norms["s"])


def test_bf16_rows_and_no_norm_limit():
    x = torch.randn(10, 4).bfloat16()
    pos = torch.arange(10)
    rows = RowFilter(FilterConfig(max_norm_ratio=None))
    assert torch.equal(rows("s", x, pos), pos > 0)
    assert rows.counts["s"]["first_position"] == 1 and rows.norms == {}
