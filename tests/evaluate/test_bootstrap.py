"""The bootstrap over documents against a hand-written resampling loop."""

import numpy as np
import pytest
import torch

from conceptlens.evaluate.bootstrap import bootstrap, bootstrap_draws, document_weights, per_document


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
