"""The bootstrap over documents against a hand-written resampling loop."""

import numpy as np
import pytest
import torch

from conceptlens.evaluate.bootstrap import bootstrap, bootstrap_draws, document_weights, paired_difference, per_document


def test_bootstrap_of_a_ratio_equals_resampling_documents_by_hand():
    g = torch.Generator().manual_seed(0)
    correct = torch.randint(0, 5, (40,), generator=g).double()
    rows = correct + torch.randint(1, 4, (40,), generator=g).double()
    per_doc = torch.stack([correct, rows], 1)
    est = bootstrap(per_doc, lambda t: t[..., 0] / t[..., 1], draws=500, seed=3)
    assert est.value == pytest.approx(float(correct.sum() / rows.sum()))
    # the same replicates drawn by hand: documents picked with replacement by the same generator
    picks = torch.randint(40, (500, 40), generator=torch.Generator().manual_seed(3)).numpy()
    ratios = np.array([correct.numpy()[p].sum() / rows.numpy()[p].sum() for p in picks])
    assert (est.low, est.high) == pytest.approx(tuple(np.quantile(ratios, [0.025, 0.975])))
    w = document_weights(40, 500, 3)
    assert torch.equal(w.sum(1), torch.full((500,), 40.0, dtype=torch.float64))


def test_bootstrap_draws_average_the_draws_and_pool_their_replicates():
    a = torch.tensor([[1.0, 2.0], [1.0, 2.0], [0.0, 2.0]])
    b = torch.tensor([[2.0, 2.0], [2.0, 2.0], [2.0, 2.0]])
    est = bootstrap_draws([a, b], lambda t: t[..., 0] / t[..., 1], draws=200)
    assert est.value == pytest.approx((2 / 6 + 1.0) / 2)
    assert est.high == 1.0 and est.low < 0.5  # b is always 1; a varies with the documents drawn


def test_per_document_sums_rows_by_document():
    out = per_document(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2, 0, 2]), 4)
    assert out.flatten().tolist() == [2.0, 0.0, 4.0, 0.0]


def _mean(t):
    return t[..., 0] / t[..., 1]


def test_paired_difference_of_identical_rows_is_zero_with_a_zero_width_interval():
    scores = torch.rand(16, generator=torch.Generator().manual_seed(1)).double()
    rows = torch.stack([scores, torch.ones(16, dtype=torch.float64)], 1)
    assert tuple(paired_difference(rows, rows.clone(), _mean)) == pytest.approx((0.0, 0.0, 0.0), abs=1e-12)
    # unpaired, the two rows' own intervals are wide: the pairing is what removes the prompts' spread
    own = bootstrap(rows, _mean)
    assert own.high - own.low > 0.1


def test_paired_difference_of_a_constant_shift_is_that_shift():
    scores = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 0.5, 0.25, 0.0], dtype=torch.float64)
    ones = torch.ones(8, dtype=torch.float64)
    est = paired_difference(torch.stack([scores + 0.125, ones], 1), torch.stack([scores, ones], 1), _mean)
    assert est == pytest.approx((0.125, 0.125, 0.125))


def test_paired_difference_equals_resampling_prompts_jointly_by_hand():
    g = torch.Generator().manual_seed(2)
    a, b = torch.rand(12, generator=g).double(), torch.rand(12, generator=g).double()
    a[3] = float("nan")  # an empty continuation: left out of its row's mean
    rows = [torch.stack([v.nan_to_num(0.0), (~v.isnan()).double()], 1) for v in (a, b)]
    est = paired_difference(rows[0], rows[1], _mean, draws=400, seed=5)
    assert est.value == pytest.approx(float(np.nanmean(a.numpy()) - b.numpy().mean()))
    picks = torch.randint(12, (400, 12), generator=torch.Generator().manual_seed(5)).numpy()
    diffs = np.array([np.nanmean(a.numpy()[p]) - b.numpy()[p].mean() for p in picks])
    assert (est.low, est.high) == pytest.approx(tuple(np.quantile(diffs[np.isfinite(diffs)], [0.025, 0.975])))


def test_paired_difference_needs_the_same_documents():
    with pytest.raises(ValueError, match="same documents"):
        paired_difference(torch.ones(4, 2), torch.ones(5, 2), _mean)
