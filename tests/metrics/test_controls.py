"""Honest controls and baselines: positions, matched controls, their spread, warnings, baselines."""

from __future__ import annotations

import math

import pytest
import torch

import conceptlens
from conceptlens import ConceptSet
from conceptlens.metrics.controls import (SiteMoments, base_rate_entropy, concept_subsets, covariance_directions,
                                          majority_accuracy, unigram_entropy)
from conceptlens.metrics.faithfulness import FaithfulnessResult, ProbeTask, faithfulness
from tests.conftest import Batches, tiny_model

SITE = "blocks.0.resid_out"


def test_baselines_equal_sklearn_dummies_and_the_entropy_by_hand():
    from sklearn.dummy import DummyClassifier
    from sklearn.metrics import log_loss

    g = torch.Generator().manual_seed(0)
    y_train, y_test = torch.randint(3, (200,), generator=g), torch.randint(3, (80,), generator=g)
    prior = torch.bincount(y_train).double() / 200
    assert base_rate_entropy(y_train, y_test) == pytest.approx(
        log_loss(y_test.numpy(), prior.expand(80, 3).numpy(), labels=[0, 1, 2]))
    dummy = DummyClassifier(strategy="most_frequent").fit(torch.zeros(200, 1).numpy(), y_train.numpy())
    assert majority_accuracy(y_train, y_test) == pytest.approx(dummy.score(torch.zeros(80, 1).numpy(), y_test.numpy()))
    assert unigram_entropy(torch.tensor([5, 5, 7, 9])) == pytest.approx(-(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)))


def test_covariance_directions_follow_the_covariance_and_concept_subsets_avoid_the_chosen():
    g = torch.Generator().manual_seed(0)
    cov = torch.diag(torch.tensor([100.0, 100.0] + [0.01] * 30))
    rows = covariance_directions(2, cov, g)
    torch.testing.assert_close(rows @ rows.T, torch.eye(2), atol=1e-5, rtol=0)
    assert rows[:, :2].norm() ** 2 > 1.99  # the span is (almost) the two high-variance axes
    subsets = concept_subsets(10, 3, [2, 5, 7], 20, g)
    assert all(len(set(s)) == 3 and not set(s) & {2, 5, 7} for s in subsets)
    with pytest.raises(ValueError, match="need 3 concepts besides the chosen ones; the set has 2"):
        concept_subsets(5, 3, [0, 1, 2], 2, g)
    moments = SiteMoments()
    x = torch.randn(50, 4, generator=g)
    moments.update(x[:20])
    moments.update(x[20:])
    torch.testing.assert_close(moments.cov, torch.cov(x.T.double(), correction=0))


def test_spread_warnings_and_baselines_in_the_summary():
    noisy = FaithfulnessResult("next_token_loss", 3.0, 8.0, torch.tensor([4.0, 7.0, 10.0, 5.0, 9.0]), 32,
                               baseline=7.5, control_kind="random")
    text = noisy.summary()
    assert "clean 3.0000 (unigram entropy 7.5000)" in text and "7.0000 +- 2.5495" in text
    assert "controls alone remove 89% of the clean model's margin" in text
    assert "the controls disagree" in text and "not distinguishable" in text
    clear = FaithfulnessResult("accuracy", 0.95, 0.3, torch.tensor([0.94, 0.95, 0.93, 0.95, 0.94, 0.96]), 2,
                               baseline=0.2, zero_ablated=0.2)
    assert clear.warnings == [] and "(chance 0.2000)" in clear.summary() and "site zeroed" in clear.summary()
    useless = FaithfulnessResult("log_loss", 0.55, 0.6, torch.tensor([0.56, 0.57]), 1, baseline=0.5)
    assert any("does not beat the base-rate entropy" in w for w in useless.warnings)
    assert any("only 2 controls" in w for w in useless.warnings)


def test_default_positions_leave_the_first_token_alone():
    """Two-token texts: the only prediction reads position 0, so an ablation that spares it changes nothing."""
    lens = conceptlens.attach(tiny_model("llama"))
    texts = torch.randint(3, 99, (16, 2), generator=torch.Generator().manual_seed(0)).tolist()
    directions = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    spared = faithfulness(lens, directions, texts, site=SITE, n_controls=2)
    assert spared.ablated == spared.clean and (spared.controls == spared.clean).all()
    everywhere = faithfulness(lens, directions, texts, site=SITE, n_controls=2, positions="all")
    assert everywhere.ablated != everywhere.clean and math.isfinite(everywhere.baseline)


def anisotropic_setup():
    """A tiny Llama whose embeddings are 30x larger on 4 axes: the activations' variance lives there."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.get_input_embeddings().weight[:, :4] *= 30
    texts = torch.randint(3, 99, (48, 10), generator=torch.Generator().manual_seed(0)).tolist()
    return conceptlens.attach(model), texts


def test_matched_controls_carry_variance_that_isotropic_ones_miss():
    lens, texts = anisotropic_setup()
    direction = torch.randn(4, 32, generator=torch.Generator().manual_seed(3))
    iso = faithfulness(lens, direction, texts, site=SITE, controls="random")
    cov = faithfulness(lens, direction, texts, site=SITE, controls="covariance")
    assert iso.clean == cov.clean and iso.ablated == cov.ablated and len(cov.controls) == 8
    assert cov.control_harm > 3 * iso.control_harm > 0
    assert cov.control_std > 0 and "+-" in cov.summary()


def test_concept_controls_come_from_the_same_set_and_are_centred_like_the_concepts():
    lens, texts = anisotropic_setup()
    g = torch.Generator().manual_seed(4)
    full = ConceptSet(torch.randn(12, 32, generator=g), site=SITE, method="kmeans", mean=torch.randn(32, generator=g))
    chosen = full.centred()[[1, 4]]
    result = faithfulness(lens, chosen, texts, controls="concepts", control_set=full, n_controls=4, mode="mean")
    assert result.control_kind == "concepts" and result.mode == "mean" and len(result.controls) == 4
    by_hand = faithfulness(lens, chosen, texts, controls="concepts", control_set=full.centred(), n_controls=4,
                           mode="mean")
    assert torch.equal(result.controls, by_hand.controls)  # the uncentred set was centred to match
    with pytest.raises(ValueError, match="need 2 concepts besides the chosen ones; the set has 1"):
        small = ConceptSet(full.directions[:3], site=SITE)
        faithfulness(lens, small[[0, 1]], texts, controls="concepts", control_set=small, n_controls=2)


def test_probe_task_reports_its_baseline():
    lens, texts = anisotropic_setup()
    labels = [i % 3 for i in range(len(texts))]
    result = faithfulness(lens, torch.randn(1, 32), texts, site=SITE, task=ProbeTask(labels, metric="accuracy"),
                          n_controls=2)
    assert 0.2 < result.baseline < 0.5  # three balanced classes, majority guess on the held-out half


def test_raw_centroids_ablate_the_planted_mean_centred_ones_do_not():
    """A planted mean at blocks.0: projecting out raw k-means centroids costs what the mean direction
    alone costs; the centred centroids cost much less (the issue's SmolLM2 finding, in miniature)."""
    from conceptlens.concepts.kmeans import StreamingKMeans

    model = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    mean_dir = torch.nn.functional.normalize(torch.randn(32, generator=g), dim=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # a confident model, scored on its own samples: ablations can hurt
        model.get_input_embeddings().weight.add_(0.5 * mean_dir)  # every token carries the planted mean
        start = torch.randint(3, 99, (48, 1), generator=g)
        torch.manual_seed(0)
        texts = model.generate(start, attention_mask=torch.ones_like(start), max_new_tokens=11, do_sample=True,
                               pad_token_id=0)
    lens = conceptlens.attach(model)
    km = StreamingKMeans(n_concepts=4, seed=0)
    seen = Batches()
    with torch.no_grad(), lens.capture(SITE, on_batch=seen):
        model(texts)
    km.update(seen.acts[SITE][seen.meta.position > 0])
    km.flush()
    cs = km.concept_set()
    cs.site = SITE
    assert (torch.nn.functional.normalize(cs.directions, dim=1) @ mean_dir).min() > 0.9
    ids = texts.tolist()
    raw = faithfulness(lens, cs[[0, 1]], ids, batch_size=48, n_controls=4)
    alone = faithfulness(lens, ConceptSet(cs.mean, site=SITE), ids, batch_size=48, n_controls=4)
    centred = faithfulness(lens, cs.centred()[[0, 1]], ids, batch_size=48, n_controls=4)
    assert raw.harm > 1 and alone.harm > 0.8 * raw.harm  # the raw harm is the mean's (measured: +5.4 and +5.4)
    assert centred.harm < 0.2 * raw.harm  # measured +0.12
