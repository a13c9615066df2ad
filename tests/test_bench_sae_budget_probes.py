"""benchmarks/sae_budget_probes.py: the fit reads no pool article, so the probes score unseen text."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import sae_budget_probes  # noqa: E402


def test_the_fit_text_leaves_out_every_copy_of_a_pool_article_and_keeps_the_rest():
    train = ["a", "b", "c", "b", "d"]  # bbc-news repeats some articles: both copies of a pooled one go
    texts = sae_budget_probes.fit_texts(train, {"b", "d"}, ["x", "y"], seed=0)
    assert sorted(texts) == ["a", "c", "x", "y"]
    assert texts == sae_budget_probes.fit_texts(train, {"b", "d"}, ["x", "y"], seed=0)  # the seed fixes the order
    orders = {tuple(sae_budget_probes.fit_texts(train, {"b", "d"}, ["x", "y"], seed=s)) for s in range(10)}
    assert len(orders) > 1
