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
from conceptlens.evaluate import results
from conceptlens.evaluate.lines import Line, format_lines, verdict
from conceptlens.evaluate.results import JUDGE
from conceptlens.evaluate.steering import SteeringConfig, against_diff_of_means, select_concepts, steering_lines
from tests.tiny_folder import save_tiny_llama


def test_selection_is_the_largest_signed_mean_difference():
    z = torch.tensor([[0.0, 5.0, 1.0], [0.0, 4.0, 1.0], [3.0, 0.0, 0.0], [9.0, 0.0, 0.0]])
    y = torch.tensor([1, 1, 0, 0])  # concept 0 differs most but is lower on label 1: not chosen
    probed = Probed(torch.zeros(4, 2), {"s": z}, y, torch.arange(4))
    assert select_concepts(probed, 1) == {"s": 1}
    assert select_concepts(probed, 0) == {"s": 0}


def test_against_diff_of_means_counts_paired_verdicts_by_hand():
    def line(name, label, diff):
        return Line(name, f"steer bbc-news {label}: P({label}) minus diff-of-means", diff,
                    [("no difference", Estimate(0.0, 0.0, 0.0))])

    nan = Estimate(math.nan, math.nan, math.nan)
    lines = [line("topk", "a", Estimate(-0.4, -0.5, -0.3)),     # worse, interval below 0
             line("topk", "b", Estimate(-0.05, -0.2, 0.1)),     # like, lower point value
             line("topk", "c", Estimate(-0.2, -0.3, -0.1)),     # worse
             line("topk", "d", nan),                            # a row over budget: not compared
             line("kmeans", "a", Estimate(0.3, 0.1, 0.5)),      # better
             Line("topk", "steer bbc-news a: P(a) minus random", Estimate(-0.4, -0.5, -0.3),
                  [("no difference", Estimate(0.0, 0.0, 0.0))]),
             Line("topk", "steer bbc-news a: P(a)", Estimate(0.2, 0.1, 0.3), [("random direction", nan)]),
             Line(JUDGE, "bbc-news judge held-out accuracy", Estimate(0.9, 0.8, 1.0), [])]
    said = against_diff_of_means(lines).splitlines()
    assert said == ["topk: its chosen concept steers worse than diff-of-means on 2 of 3 labels, like it on 1, better "
                    "on 0 (paired 95% intervals over the prompts; lower on 3 by the point value): where the intervals "
                    "tell them apart, it steers worse than the supervised vector",
                    "kmeans: its chosen concept steers worse than diff-of-means on 0 of 1 labels, like it on 0, better "
                    "on 1 (paired 95% intervals over the prompts; lower on 0 by the point value): where the intervals "
                    "tell them apart, it steers better than the supervised vector"]


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
    steer = [ln for ln in lines if ln.metric.startswith("steer") and " minus " not in ln.metric
             and ln.concept is None]
    assert [ln.metric.split(": ")[0].split(" ")[-1] for ln in steer] == labels
    pages = [ln for ln in lines if ln.concept is not None]  # the same figures again, for the concept's page
    assert [ln._replace(concept=None) for ln in pages if " minus " not in ln.metric] == steer
    assert all(ln.note.startswith(f"concept {ln.concept} at ") for ln in pages if " minus " not in ln.metric)
    paired = [ln for ln in lines if " minus " in ln.metric]  # and the paired differences with them
    assert [ln._replace(concept=None) for ln in paired if ln.concept is not None] == \
        [ln for ln in paired if ln.concept is None] and len(paired) == 4 * len(steer)
    assert against_diff_of_means(lines) == against_diff_of_means([ln for ln in lines if ln.concept is None])
    assert all([name for name, _ in ln.baselines] == ["random direction", "diff-of-means", "prompt prefix"]
               for ln in steer)
    assert sum(ln.extractor == JUDGE for ln in lines) == 4
    for _ in range(2):  # saved, and saved again as a rerun: the judges' lines read back, once each
        run = folder.parent / "steered-run"
        sets["dense"].save(run / "concepts" / "dense")
        infos = {"dense": results.set_info(sets["dense"], run / "concepts" / "dense", site)}
        results.save_part(run, results.Part("tiny", infos, site, "steering", {"seed": 0}, 1.0), lines)
    back = results.load_results(run)
    assert [sl.line for sl in back.lines if sl.line.extractor == JUDGE] == [ln for ln in lines if ln.extractor == JUDGE]
    # the judge's P(label) at the chosen alpha, recomputed: sklearn on hand mean-pooled embeddings of
    # the train-split documents the concepts were not chosen on, in the seeded order, while the
    # token budget lasts
    task, label, judge, rows = record[0]
    full = data.load(task, "train")
    chosen_on = set(act.pick(len(full), config.train_docs, config.seed))
    chosen_texts = {full.texts[i] for i in chosen_on}
    order, used = [], 0
    for i in torch.randperm(len(full), generator=torch.Generator().manual_seed(config.seed + 1)).tolist():
        if full.texts[i] not in chosen_texts and used < config.judge_tokens:
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
    test = data.load(task, "test")  # the judge's held-out accuracy: the reference's on test-split documents,
    learnt = {full.texts[i] for i in order}  # none a copy of one it learned on
    held = [i for i in act.pick(len(test), len(test), config.seed + 1) if test.texts[i] not in learnt]
    held = held[:config.judge_docs]
    right = reference.predict(pooled([test.texts[i] for i in held])) == [test.label_names[test.labels[i]]
                                                                          if isinstance(test.labels[i], int)
                                                                          else test.labels[i] for i in held]
    accuracy = next(ln for ln in lines if ln.metric == f"{task} judge held-out accuracy")
    assert accuracy.value.value == pytest.approx(float(np.mean(right)))
    assert not math.isnan(line.value.low) and line.value.low <= line.value.value <= line.value.high
    # each set's row minus diff-of-means and minus random: the paired bootstrap of the rows' own
    # per-prompt scores, each at its own best alpha, by hand
    names = [ln.metric for ln in lines if ln.extractor == "dense" and ln.concept is None]
    assert names[:3] == [line.metric, f"{line.metric} minus diff-of-means", f"{line.metric} minus random"]
    assert len(names) == 3 * len(labels)
    found = {r["row"]: r for r in rows}
    for paired, base in zip(lines[lines.index(line) + 1:][:2], ("diff-of-means", "random")):
        def at_best(row):
            return np.asarray(row["scores"][row["alphas"].index(row["best"][0])])
        a, b = at_best(concept), at_best(found[base])
        assert paired.value.value == pytest.approx(np.nanmean(a) - np.nanmean(b))
        picks = torch.randint(len(a), (1000, len(a)), generator=torch.Generator().manual_seed(config.seed)).numpy()
        diffs = np.array([np.nanmean(a[p]) - np.nanmean(b[p]) for p in picks])
        assert (paired.value.low, paired.value.high) == pytest.approx(tuple(np.quantile(diffs, [0.025, 0.975])))
        assert paired.baselines == [("no difference", Estimate(0.0, 0.0, 0.0))]
        said = {"wins": "better than", "loses": "worse than", "overlaps": "like"}[verdict(paired)]
        assert paired.note.startswith(f"steers {said} {base} (paired bootstrap over the 2 prompts")
    table = format_lines(lines)
    assert f"| dense | {line.metric} minus diff-of-means | {lines[lines.index(line) + 1].value} |" in table
    verdicts = [verdict(ln) for ln in lines if ln.extractor == "dense" and ln.metric.endswith(" minus diff-of-means")
                and ln.concept is None]  # a concept page's copies are not counted again
    counted = [v for v in verdicts if v]
    worse, like, better = (counted.count(v) for v in ("loses", "overlaps", "wins"))
    summary = against_diff_of_means(lines)
    assert summary.startswith(f"dense: its chosen concept steers worse than diff-of-means on {worse} of {len(counted)} "
                              f"labels, like it on {like}, better on {better} ") if counted else summary == ""


def test_the_judge_learns_on_no_copy_of_a_document_the_concepts_are_chosen_on(tiny, monkeypatch):
    """A labelled set may hold one text twice (bbc-news does): the judge's train documents leave out
    every copy of the concepts' documents, not only their indices."""
    from conceptlens.evaluate import steering
    from conceptlens.steering import judge as judge_module

    folder, model, tok = tiny
    texts = [f"w{i} w{i + 1} w{i + 2}" for i in range(12)]
    texts[7] = texts[3]  # index 7 repeats the chosen document 3
    labels = [i % 2 for i in range(12)]
    fake = {split: data.TextSet("two", split, list(texts), list(labels), ["a", "b"]) for split in ("train", "test")}
    monkeypatch.setattr(data, "load", lambda name, split="train", **kw: fake[split])
    learnt: list[list[str]] = []
    real = judge_module.TopicJudge

    def spy(encoder, encoder_tok, fit_texts, *args, **kwargs):
        learnt.append(list(fit_texts))
        return real(encoder, encoder_tok, fit_texts, *args, **kwargs)

    monkeypatch.setattr(judge_module, "TopicJudge", spy)
    config = SteeringConfig(judge_tokens=10_000, judge_docs=12, max_length=24)
    steering._judge("two", model, tok, tok, [3], config)
    assert len(learnt[0]) == 10 and texts[3] not in learnt[0]
