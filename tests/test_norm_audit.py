"""NormAudit: the variance share of the largest-norm rows, exact while the sample holds every row."""

from __future__ import annotations

import pytest
import torch

import conceptlens
from conceptlens.norm_audit import NormAudit
from tests.conftest import CharTokenizer, tiny_model
from tests.test_fit import DOCS


def test_share_matches_hand_computation_and_catches_planted_outliers():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 16, generator=g)
    x[:20] *= 30  # 1% of the rows at ~30x the typical norm
    audit = NormAudit(size=4096, top_fraction=0.01)
    for chunk in x.split(300):
        audit.update(chunk)
    s = audit.stats()
    xd = x.double()
    spread = (xd - xd.mean(0)).pow(2).sum(1)
    expected = spread[xd.norm(dim=1).topk(20).indices].sum() / spread.sum()
    assert s["rows"] == 2000 and s["sample"] == 2000
    assert s["top_share"] == pytest.approx(float(expected), rel=1e-9)
    assert s["top_share"] > 0.8 and s["max_norm_ratio"] > 20
    clean = NormAudit(size=4096)
    clean.update(torch.randn(2000, 16, generator=g))
    assert clean.stats()["top_share"] < 0.05
    assert "carry" in audit.summary()


def test_resume_is_exact_and_merge_pools_samples():
    g = torch.Generator().manual_seed(1)
    chunks = [torch.randn(500, 8, generator=g) for _ in range(6)]
    whole = NormAudit(size=1000)
    for c in chunks:
        whole.update(c)
    first = NormAudit(size=1000)
    for c in chunks[:3]:
        first.update(c)
    resumed = NormAudit(size=1000)
    resumed.load_state_dict(first.state_dict())
    for c in chunks[3:]:
        resumed.update(c)
    assert torch.equal(resumed.sample, whole.sample) and resumed.n_seen == whole.n_seen
    a, b = NormAudit(size=1000, seed=2), NormAudit(size=1000, seed=3)
    a.update(chunks[0])
    b.update(chunks[1] + 100)  # b's rows are recognisable
    a.merge(b)
    assert a.n_seen == 1000 and int((a.sample.mean(1) > 50).sum()) == 500


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="size"):
        NormAudit(size=10)
    with pytest.raises(ValueError, match="top_fraction"):
        NormAudit(top_fraction=0.7)


def test_fit_reports_it_next_to_the_extractors():
    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    audit = NormAudit(size=128)
    report = lens.fit({"blocks.1.resid_out": {"norms": audit}}, DOCS, max_length=16, progress=False)
    assert report.stats["norms"]["rows"] == audit.n_seen > 0
