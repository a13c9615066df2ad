"""benchmarks/lr_budget.py on tiny shards, so the script behind `short_budget_lr` cannot rot."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import lr_budget  # noqa: E402


def shards(folder: Path, sizes: list[int], d: int = 8) -> None:
    folder.mkdir(parents=True)
    start = 0
    for j, n in enumerate(sizes):
        x = torch.arange(start, start + n, dtype=torch.float16)[:, None].repeat(1, d)  # row i holds i
        torch.save(x, folder / f"shard-{j:03d}.pt")
        start += n


def test_rows_hold_out_the_last_shard_and_train_on_the_ones_before(tmp_path):
    shards(tmp_path / "train-512", [30, 30, 20])
    train, test = lr_budget.rows(tmp_path, 512, train=50, held_out=8)
    ids, held = set(train[:, 0].tolist()), set(test[:, 0].tolist())
    assert len(train) == 50 and len(ids) == 50 and ids <= set(range(60))  # distinct rows of the first two shards
    assert len(test) == 8 and held <= set(range(60, 80))  # rows of the last shard only
    assert test.dtype == torch.float32
    with pytest.raises(ValueError, match="the shards before the last hold 60"):
        lr_budget.rows(tmp_path, 512, train=61, held_out=8)


def test_decay_falls_linearly_to_the_last_step():
    assert [lr_budget.decay_factor(s, 10, None) for s in range(10)] == [1.0] * 10
    assert [lr_budget.decay_factor(s, 10, 6) for s in range(10)] == [1.0] * 6 + [1.0, 0.75, 0.5, 0.25]


def test_a_budgets_constant_lr_fit_is_the_prefix_of_the_longest():
    from conceptlens.concepts.sae import TopKSAE

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * 32, 16, generator=g) @ torch.randn(16, 16, generator=g)
    test = torch.randn(64, 16, generator=g)
    long, _ = lr_budget.fit(TopKSAE, [1.0, 10.0], x, test, batch=32, width=32, k=4, evals=[2, 8])
    short, _ = lr_budget.fit(TopKSAE, [1.0, 10.0], x, test, batch=32, width=32, k=4, evals=[2])
    assert all(long[m][0] == short[m][0] for m in (1.0, 10.0)) and long[1.0][1] != long[10.0][1]
    constant, _ = lr_budget.fit(TopKSAE, [10.0], x, test, batch=32, width=32, k=4, evals=[4])
    decayed, _ = lr_budget.fit(TopKSAE, [10.0], x, test, batch=32, width=32, k=4, evals=[4], decay_from=2)
    assert decayed[10.0][0] != constant[10.0][0]  # the last step took half the lr
    table = lr_budget.table("t", [64, 256], 32, long, base=1e-3)
    assert "64 (2)" in table and "256 (8)" in table and "10x (1.00e-02)" in table
