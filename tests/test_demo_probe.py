"""The demo's per-topic probe table: the suite's probes one topic at a time, planted topics win, the ceiling."""

import torch
import torch.nn.functional as F

from conceptlens.commands.demo_probe import CEILING, format_topics, summary, topic_lines
from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.evaluate.activations import Probed, pool_documents
from conceptlens.evaluate.lines import verdict
from conceptlens.evaluate.probing import binary_tasks
from conceptlens.evaluate.readings import READINGS, probe_readers


def _docs(sets: dict, n_docs: int, d: int, topics: torch.Tensor, seed: int, draws: int = 3) -> Probed:
    """Documents of 6 tokens, each token noise plus its document's topic direction (one per class),
    read by every reading of `sets` and their controls, mean-pooled."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(3, (n_docs,), generator=g)
    doc = torch.arange(n_docs).repeat_interleave(6)
    x = torch.randn(len(doc), d, generator=g) + 2.0 * topics[y[doc]] + 5.0  # an offset, as residuals have
    return pool_documents(probe_readers(sets, READINGS, draws=draws), x, doc, y)


def test_planted_topic_directions_beat_matched_random_and_the_control_matches_the_count():
    d = 256
    topics = F.normalize(torch.randn(3, d, generator=torch.Generator().manual_seed(11)), dim=1)
    mean = 5.0 * torch.ones(d)
    filler = torch.randn(29, d, generator=torch.Generator().manual_seed(4))
    planted = ConceptSet(torch.cat([topics + mean, filler + mean]), "s", method="kmeans", mean=mean)
    noise = ConceptSet(torch.randn(32, d, generator=torch.Generator().manual_seed(5)) + mean, "s", method="kmeans",
                       mean=mean)
    sets = {"planted": planted, "noise": noise}
    train, test = _docs(sets, 300, d, topics, 2), _docs(sets, 300, d, topics, 3)
    lines = topic_lines(train, test, ["a", "b", "c"], k=1, reading="activation")
    ours = [ln for ln in lines if ln.extractor == "planted"]
    assert [ln.metric for ln in ours] == ["a k=1 accuracy", "b k=1 accuracy", "c k=1 accuracy"]
    assert all(ln.baselines[0][0] == "random 32 dirs" for ln in lines)
    assert all(verdict(ln) == "wins" for ln in ours), [(ln.value, ln.baselines[0][1]) for ln in ours]
    assert "planted: beats matched random directions on every topic" in summary(lines)
    assert not any(verdict(ln) == "wins" for ln in lines if ln.extractor == "noise")
    assert "noise: does NOT beat" in summary(lines)


def test_ceiling_is_sklearns_logistic_probe_on_every_pooled_coordinate():
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    d = 16
    topics = F.normalize(torch.randn(3, d, generator=torch.Generator().manual_seed(1)), dim=1)
    sets = {"p": ConceptSet(torch.randn(4, d, generator=torch.Generator().manual_seed(4)), "s", method="random")}
    train, test = _docs(sets, 90, d, topics, 2, draws=2), _docs(sets, 90, d, topics, 3, draws=2)
    lines = topic_lines(train, test, ["a", "b", "c"], k=1, reading="code")
    for line, task in zip(lines, binary_tasks(train.y, test.y, ["a", "b", "c"], 0)):
        model = make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=1000))
        model.fit(train.x[task.train].double().numpy(), task.y_train.numpy())
        expected = (model.predict(test.x[task.test].double().numpy()) == task.y_test.numpy()).mean()
        ceiling = dict(line.baselines)[CEILING]
        assert abs(ceiling.value - expected) < 1e-12 and ceiling.low <= ceiling.value <= ceiling.high
        assert line.note == f"balanced binary task, {len(task.test)} test rows"  # this topic's, not a mean
    printed = format_topics(lines) + "\n" + summary(lines)
    assert printed.count("ceiling (full probe)") == 3
    assert "p: does NOT beat" in printed  # random directions against random directions
    assert "room between the control's upper bound and the full probe's accuracy: a " in printed
