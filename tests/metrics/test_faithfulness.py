"""Faithfulness: the probe against sklearn, the loss against HF's, true directions against controls."""

from __future__ import annotations

import math

import pytest
import torch

import conceptlens
from conceptlens import ConceptSet
from conceptlens.metrics.faithfulness import (FaithfulnessResult, ProbeTask, faithfulness, fit_probe, pool,
                                              probe_scores, random_orthonormal)
from tests.conftest import Batches, tiny_model

SITE = "blocks.0.resid_out"


def test_probe_equals_sklearn():
    from sklearn.linear_model import LogisticRegression

    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 6, generator=g) * torch.tensor([1.0, 5.0, 0.1, 2.0, 1.0, 30.0]) + 3
    y = ((x[:, :3] - 3) / torch.tensor([1.0, 5.0, 0.1]) + torch.randn(300, 3, generator=g)).argmax(1)
    probe = fit_probe(x, y, C=0.5)
    z = ((x.double() - x.double().mean(0)) / x.double().std(0, correction=0)).numpy()
    reference = LogisticRegression(C=0.5, tol=1e-10, max_iter=10_000).fit(z, y.numpy())
    ours = probe.logits(x).softmax(-1)
    torch.testing.assert_close(ours, torch.from_numpy(reference.predict_proba(z)), atol=1e-5, rtol=0)
    scores = probe_scores(probe, x, y)
    assert scores["accuracy"] == pytest.approx(reference.score(z, y.numpy()))
    assert scores["log_loss"] == pytest.approx(-ours.log()[torch.arange(300), y].mean().item())


def test_random_orthonormal_is_orthonormal_and_seeded():
    a = random_orthonormal(4, 32, torch.Generator().manual_seed(3))
    torch.testing.assert_close(a @ a.T, torch.eye(4), atol=1e-6, rtol=0)
    assert torch.equal(a, random_orthonormal(4, 32, torch.Generator().manual_seed(3)))
    assert not torch.equal(a, random_orthonormal(4, 32, torch.Generator().manual_seed(4)))


def test_pool_skips_the_first_token_and_finds_the_last():
    acts = torch.arange(12.0).reshape(6, 2)  # text 0: positions 0-2, text 1: 0-1, text 2: one token
    row, position = torch.tensor([0, 0, 0, 1, 1, 2]), torch.tensor([0, 1, 2, 0, 1, 0])
    torch.testing.assert_close(pool(acts, row, position, 3, "mean"), torch.stack([acts[1:3].mean(0), acts[4], acts[5]]))
    torch.testing.assert_close(pool(acts, row, position, 3, "last"), acts[[2, 4, 5]])


def test_result_harm_and_z_by_hand():
    loss = FaithfulnessResult("log_loss", 0.2, 1.0, torch.tensor([0.3, 0.5]), 1)
    assert loss.harm == pytest.approx(0.8) and loss.control_harm == pytest.approx(0.2)
    assert loss.z == pytest.approx((0.8 - 0.2) / math.sqrt(0.02))
    accuracy = FaithfulnessResult("accuracy", 0.9, 0.5, torch.tensor([0.9, 0.8]), 1)
    assert accuracy.harm == pytest.approx(0.4) and accuracy.control_harm == pytest.approx(0.05)
    assert "z = " in accuracy.summary()


@pytest.fixture(scope="module")
def probe_setup():
    """200 random texts; labels: the sign of each text's pooled activation on its top principal axis."""
    model = tiny_model("llama")
    lens = conceptlens.attach(model)
    texts = torch.randint(3, 99, (200, 8), generator=torch.Generator().manual_seed(0))
    seen = Batches()
    with torch.no_grad(), lens.capture(SITE, keep_shape=True, on_batch=seen):
        model(texts)
    pooled = seen.acts[SITE][:, 1:].mean(1)  # (200, 32): equal lengths, first token skipped
    u = torch.linalg.svd(pooled - pooled.mean(0), full_matrices=False).Vh[0]
    labels = (pooled @ u > (pooled @ u).median()).long()
    return lens, texts.tolist(), labels, u


@pytest.mark.parametrize("metric", ["log_loss", "accuracy"])
def test_ablating_the_probed_direction_hurts_more_than_random(probe_setup, metric):
    lens, texts, labels, u = probe_setup
    result = faithfulness(lens, ConceptSet(u, site=SITE), texts, task=ProbeTask(labels, metric=metric))
    assert result.metric == metric and result.n_directions == 1 and len(result.controls) == 8
    if metric == "accuracy":
        assert result.clean > 0.85 and result.ablated < 0.65  # the probe is left guessing
    assert result.harm > 0.3 and result.z > 5


def test_next_token_loss_equals_hf_and_padding_changes_nothing():
    model = tiny_model("llama")
    lens = conceptlens.attach(model)
    texts = [torch.randint(3, 99, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 4, 7)]
    with torch.no_grad():
        losses = [model(torch.tensor([t]), labels=torch.tensor([t])).loss * (len(t) - 1) for t in texts]
    expected = float(sum(losses)) / sum(len(t) - 1 for t in texts)
    for batch_size in (1, 3):  # 3: one right-padded batch
        result = faithfulness(lens, torch.randn(2, 32), texts, site=SITE, batch_size=batch_size, n_controls=2)
        assert result.clean == pytest.approx(expected, rel=1e-5)


def test_next_token_loss_needs_the_directions_it_uses():
    """A confident model scored on its own samples: its top final-norm axes matter, random ones less."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
        start = torch.randint(3, 99, (64, 1), generator=torch.Generator().manual_seed(0))
        torch.manual_seed(0)
        texts = model.generate(start, attention_mask=torch.ones_like(start), max_new_tokens=11, do_sample=True,
                               pad_token_id=0)
    lens = conceptlens.attach(model)
    seen = Batches()
    with torch.no_grad(), lens.capture("final", on_batch=seen):
        model(texts)
    acts = seen.acts["final"]
    top = torch.linalg.svd(acts - acts.mean(0), full_matrices=False).Vh[:2]
    result = faithfulness(lens, ConceptSet(top, site="final"), texts.tolist(), batch_size=32)
    assert result.n_directions == 2 and result.harm > 2 * result.control_harm > 0 and result.z > 3


def test_errors_name_the_problem(probe_setup):
    lens, texts, labels, u = probe_setup
    with pytest.raises(ValueError, match="before the ablated site"):
        faithfulness(lens, ConceptSet(u, site="blocks.1.resid_out"), texts, task=ProbeTask(labels, site=SITE))
    with pytest.raises(ValueError, match="before the ablated site"):  # the same block, read at its input
        faithfulness(lens, ConceptSet(u, site="blocks.1.resid_out"), texts,
                     task=ProbeTask(labels, site="blocks.1.resid_in"))
    with pytest.raises(ValueError, match="3 labels for 200 texts"):
        faithfulness(lens, ConceptSet(u, site=SITE), texts, task=ProbeTask([0, 1, 0]))
    with pytest.raises(ValueError, match="n_controls"):
        faithfulness(lens, ConceptSet(u, site=SITE), texts, n_controls=1)
    with pytest.raises(ValueError, match="site="):
        faithfulness(lens, u, texts)
    with pytest.raises(ValueError, match="tokenizer"):
        faithfulness(lens, ConceptSet(u, site=SITE), ["some text"])
    assert ProbeTask(["sport", "tech", "sport", "arts"]).y.tolist() == [1, 2, 1, 0]
    with pytest.raises(ValueError, match="two classes"):
        ProbeTask([1, 1, 1])
    with pytest.raises(ValueError, match="metric"):
        ProbeTask([0, 1], metric="f1")
    with pytest.raises(ValueError, match="task"):
        faithfulness(lens, ConceptSet(u, site=SITE), texts, task="probe")
    with pytest.raises(ValueError, match="mode must be 'projection' or 'mean'"):
        faithfulness(lens, ConceptSet(u, site=SITE), texts, mode="zero")
    with pytest.raises(ValueError, match="controls must be one of"):
        faithfulness(lens, ConceptSet(u, site=SITE), texts, controls="gaussian")
    with pytest.raises(ValueError, match="control_set="):
        faithfulness(lens, ConceptSet(u, site=SITE), texts, controls="concepts")
