"""The suite's steering part on a tiny model: the judge's score against scikit-learn on hand-pooled
embeddings, the concept chosen from train-split rows only, and the rows every label gets."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression

import conceptlens
from conceptlens import data
from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.evaluate import activations as act
from conceptlens.evaluate.activations import Probed
from conceptlens.evaluate.bootstrap import Estimate
from conceptlens.evaluate.lines import Line
from conceptlens.evaluate.steering import SteeringConfig, against_diff_of_means, select_concepts, steering_lines
from tests.tiny_folder import save_tiny_llama


def test_selection_is_the_largest_signed_mean_difference():
    z = torch.tensor([[0.0, 5.0, 1.0], [0.0, 4.0, 1.0], [3.0, 0.0, 0.0], [9.0, 0.0, 0.0]])
    y = torch.tensor([1, 1, 0, 0])  # concept 0 differs most but is lower on label 1: not chosen
    probed = Probed(torch.zeros(4, 2), {"s": z}, y, torch.arange(4))
    assert select_concepts(probed, 1) == {"s": 1}
    assert select_concepts(probed, 0) == {"s": 0}


def test_against_diff_of_means_counts_labels_by_hand():
    def line(name, label, value, dom):
        bases = [("random direction", Estimate(0.1, 0.0, 0.2)), ("diff-of-means", dom)]
        return Line(name, f"steer bbc-news {label}: P({label})", value, bases)

    dom = Estimate(0.6, 0.5, 0.7)
    lines = [line("topk", "a", Estimate(0.2, 0.1, 0.3), dom),      # worse, intervals apart
             line("topk", "b", Estimate(0.55, 0.4, 0.65), dom),    # worse, intervals overlap
             line("topk", "c", Estimate(0.8, 0.75, 0.9), dom),     # better
             line("kmeans", "a", Estimate(0.9, 0.8, 1.0), dom),
             Line("judge", "bbc-news judge held-out accuracy", Estimate(0.9, 0.8, 1.0), [])]
    said = against_diff_of_means(lines).splitlines()
    assert said[0] == ("topk: its chosen concept steers worse than diff-of-means on 2 of 3 labels (1 with the 95% "
                       "intervals apart); it steers worse than the supervised vector")
    assert said[1] == "kmeans: its chosen concept steers worse than diff-of-means on 0 of 1 labels (0 with the 95% intervals apart)"
    assert len(said) == 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_tiny_llama(tmp_path_factory.mktemp("tiny") / "m")
    model, tok = conceptlens.models.load(str(folder))
    return folder, model, tok


def test_steering_lines_judge_like_sklearn_and_select_on_train_only(tiny, monkeypatch):
    folder, model, tok = tiny
    lens = conceptlens.attach(model, tok)
    site = "blocks.1.resid_out"
    d = model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    sets = {"dense": ConceptSet(torch.randn(6, d, generator=g), site, method="kmeans", mean=torch.randn(d, generator=g))}
    train_texts = {t for task in ("bbc-news", "movie-polarity") for t in data.load(task, "train").texts}
    seen: list[str] = []
    batches = act.task_batches

    def spy(tok_, texts, *args, **kwargs):
        seen.extend(texts)
        return batches(tok_, texts, *args, **kwargs)

    monkeypatch.setattr(act, "task_batches", spy)
    config = SteeringConfig(prompts=("w5 w6", "w20 w21 w22"), alphas=(0.0, 1.0, 4.0), max_new_tokens=3, train_docs=40,
                            judge_tokens=300, judge_docs=10, judge_model=str(folder), max_length=24)
    record: list = []
    lines = steering_lines(lens, tok, site, sets, config, record)
    assert seen and all(t in train_texts for t in seen)  # the concept and diff-of-means see train documents only
    labels = [*data.load("bbc-news", "test").label_names, "negative", "positive"]
    steer = [ln for ln in lines if ln.metric.startswith("steer")]
    assert [ln.metric.split(": ")[0].split(" ")[-1] for ln in steer] == labels
    assert all([name for name, _ in ln.baselines] == ["random direction", "diff-of-means", "prompt prefix"]
               for ln in steer)
    assert sum(ln.extractor == "judge" for ln in lines) == 4
    # the judge's P(label) at the chosen alpha, recomputed: sklearn on hand mean-pooled embeddings of
    # the train-split documents the concepts were not chosen on, in the seeded order, while the
    # token budget lasts
    task, label, judge, rows = record[0]
    full = data.load(task, "train")
    chosen_on = set(act.pick(len(full), config.train_docs, config.seed))
    order, used = [], 0
    for i in torch.randperm(len(full), generator=torch.Generator().manual_seed(config.seed + 1)).tolist():
        if i not in chosen_on and used < config.judge_tokens:
            order.append(i)
            used += len(tok(full.texts[i], truncation=True, max_length=24)["input_ids"])
    assert len(order) > 5 and not chosen_on & set(order)
    names = [full.label_names[act.label_of(full, i, False)] for i in order]

    def pooled(texts):
        with torch.no_grad():
            return np.stack([model(**tok(t or " ", return_tensors="pt", truncation=True, max_length=24),
                                   output_hidden_states=True).hidden_states[-1][0].double().mean(0).numpy()
                             for t in texts])

    reference = LogisticRegression(max_iter=2000, random_state=0).fit(pooled([full.texts[i] for i in order]), names)
    concept = rows[0]
    a = concept["alphas"].index(concept["best"][0])
    texts = concept["texts"][a]
    p = reference.predict_proba(pooled(texts))[:, list(reference.classes_).index(label)]
    expected = np.mean([v for v, t in zip(p, texts) if t.strip()])
    line = steer[0]
    assert line.value.value == pytest.approx(expected, abs=1e-5)
    assert judge.classes == list(reference.classes_)
    test = data.load(task, "test")  # the judge's held-out accuracy: the reference's on test-split documents
    held = act.pick(len(test), config.judge_docs, config.seed + 1)
    right = reference.predict(pooled([test.texts[i] for i in held])) == [test.label_names[test.labels[i]]
                                                                          if isinstance(test.labels[i], int)
                                                                          else test.labels[i] for i in held]
    accuracy = next(ln for ln in lines if ln.metric == f"{task} judge held-out accuracy")
    assert accuracy.value.value == pytest.approx(float(np.mean(right)))
    assert not math.isnan(line.value.low) and line.value.low <= line.value.value <= line.value.high
