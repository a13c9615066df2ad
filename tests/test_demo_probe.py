"""The demo's per-topic probe table: matched controls read as the set is, planted topics win."""

import pytest
import torch
import torch.nn.functional as F

from conceptlens.commands.demo_probe import (CEILING, Rows, control_reader, diff_of_means, doc_max, doc_means,
                                             format_topics, set_reader, summary, topic_lines)
from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.evaluate.lines import verdict
from conceptlens.evaluate.probing import binary_tasks, random_directions


def _rows(n_docs: int, d: int, topics: torch.Tensor, seed: int) -> Rows:
    """Documents of 6 tokens; each token is noise plus its document's topic direction (one per class)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(3, (n_docs,), generator=g)
    doc = torch.arange(n_docs).repeat_interleave(6)
    x = torch.randn(len(doc), d, generator=g) + 2.0 * topics[y[doc]] + 5.0  # an offset, as residuals have
    return Rows(x, doc, y)


def test_doc_means_average_each_documents_rows():
    z = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 7.0]])
    assert torch.equal(doc_means(z, torch.tensor([0, 0, 2]), 3), torch.tensor([[2.0, 3.0], [0.0, 0.0], [5.0, 7.0]]))


def test_doc_max_takes_each_documents_largest_row_value():
    z = torch.tensor([[1.0, -2.0], [3.0, -4.0], [5.0, 7.0]])
    assert torch.equal(doc_max(z, torch.tensor([0, 0, 2]), 3), torch.tensor([[3.0, -2.0], [0.0, 0.0], [5.0, 7.0]]))


def test_diff_of_means_is_the_difference_of_document_means():
    x = torch.tensor([[1.0, 0.0], [3.0, 2.0], [0.0, 4.0], [2.0, 2.0]])
    rows = Rows(x, torch.tensor([0, 0, 1, 2]), torch.tensor([1, 0, 0]))
    # document means: [2, 1], [0, 4], [2, 2]; class 1 is document 0, the others average to [1, 3]
    torch.testing.assert_close(diff_of_means(rows, 1), torch.tensor([1.0, -2.0]))


def test_unknown_pooling_is_named():
    rows = _rows(12, 8, torch.eye(8)[:3], 0)
    with pytest.raises(ValueError, match="'median'.*mean, max"):
        topic_lines(rows, rows, {}, ["a", "b", "c"], pool="median")


def test_control_is_read_as_the_set_is():
    g = torch.Generator().manual_seed(0)
    x, mean = torch.randn(50, 16, generator=g), torch.randn(16, generator=g)
    dense = ConceptSet(torch.randn(4, 16, generator=g), "s", method="kmeans", mean=mean)
    r = random_directions(4, 16, 7)
    expected = F.normalize(x - mean, dim=1) @ r.T  # cosine to the random direction, centred on the set's mean
    torch.testing.assert_close(control_reader(dense, 4, 7)(x), expected)
    plain = ConceptSet(torch.randn(4, 16, generator=g), "s", method="random")  # no mean: the projection
    torch.testing.assert_close(control_reader(plain, 4, 7)(x), x @ r.T)


def test_planted_topic_directions_beat_matched_random_and_the_control_matches_the_count():
    d = 256
    topics = F.normalize(torch.randn(3, d, generator=torch.Generator().manual_seed(11)), dim=1)
    train, test = _rows(300, d, topics, 2), _rows(300, d, topics, 3)
    mean = train.x.mean(0)
    filler = torch.randn(29, d, generator=torch.Generator().manual_seed(4))
    planted = ConceptSet(torch.cat([topics + mean, filler + mean]), "s", method="kmeans", mean=mean)
    lines = topic_lines(train, test, {"planted": planted}, ["a", "b", "c"], k=1, draws=3)
    assert [ln.metric for ln in lines] == ["a k=1 accuracy", "b k=1 accuracy", "c k=1 accuracy"]
    assert all(ln.baselines[0][0] == "random 32 dirs x3" for ln in lines)
    assert all(verdict(ln) == "wins" for ln in lines), [(ln.value, ln.baselines[0][1]) for ln in lines]
    assert "beats matched random directions on every topic" in summary(lines)
    noise = ConceptSet(torch.randn(32, d, generator=torch.Generator().manual_seed(5)) + mean, "s", method="kmeans",
                       mean=mean)
    lines = topic_lines(train, test, {"noise": noise}, ["a", "b", "c"], k=1, draws=3)
    assert not any(verdict(ln) == "wins" for ln in lines)
    assert "does NOT beat" in summary(lines)


def test_ceiling_is_sklearns_logistic_probe_on_every_pooled_coordinate():
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    d = 16
    topics = F.normalize(torch.randn(3, d, generator=torch.Generator().manual_seed(1)), dim=1)
    train, test = _rows(90, d, topics, 2), _rows(90, d, topics, 3)
    planted = ConceptSet(torch.randn(4, d, generator=torch.Generator().manual_seed(4)), "s", method="random")
    lines = topic_lines(train, test, {"p": planted}, ["a", "b", "c"], k=1, draws=2)
    x_train, x_test = doc_means(train.x, train.doc, 90).double(), doc_means(test.x, test.doc, 90).double()
    for line, task in zip(lines, binary_tasks(train.y, test.y, ["a", "b", "c"], 0)):
        model = make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=1000))
        model.fit(x_train[task.train].numpy(), task.y_train.numpy())
        expected = (model.predict(x_test[task.test].numpy()) == task.y_test.numpy()).mean()
        ceiling = dict(line.baselines)[CEILING]
        assert abs(ceiling.value - expected) < 1e-12 and ceiling.low <= ceiling.value <= ceiling.high
    printed = format_topics(lines) + "\n" + summary(lines)
    assert printed.count("ceiling (full probe)") == 3
    assert "p: does NOT beat" in printed  # random directions against random directions
    assert "room between the control's upper bound and the full probe's accuracy: a " in printed


def _sae_set(n: int, d: int, k: int, seed: int) -> ConceptSet:
    g = torch.Generator().manual_seed(seed)
    enc = {"W_enc": torch.randn(d, n, generator=g), "b_enc": torch.randn(n, generator=g),
           "b_dec": torch.randn(d, generator=g)}
    return ConceptSet(torch.randn(n, d, generator=g), "s", method="topk", encoder=enc, config={"width": n, "k": k})


def test_code_reading_controls_an_sae_with_a_random_topk_encoder():
    from conceptlens.evaluate.activations import concept_encoder

    cs = _sae_set(12, 8, 3, 0)
    x = torch.randn(40, 8, generator=torch.Generator().manual_seed(1))
    r = random_directions(12, 8, 5)
    # the library's own TopK SAE with the random unit directions as its encoder, no encoder bias, the set's b_dec
    random_sae = ConceptSet(r, "s", method="topk", config={"width": 12, "k": 3},
                            encoder={"W_enc": r.T.contiguous(), "b_enc": torch.zeros(12), "b_dec": cs.encoder["b_dec"]})
    torch.testing.assert_close(control_reader(cs, 12, 5, "code")(x), concept_encoder(random_sae).encode(x))
    # an SAE's code is its activation
    torch.testing.assert_close(set_reader(cs, "code")(x), concept_encoder(cs).encode(x))


def test_code_reading_assigns_dense_sets_their_nearest_centre_and_the_control_its_largest_cosine():
    g = torch.Generator().manual_seed(0)
    x, mean = torch.randn(60, 16, generator=g), torch.randn(16, generator=g)
    centres = torch.randn(5, 16, generator=g) * torch.linspace(0.6, 1.4, 5)[:, None]  # unequal norms: nearest is not
    # the largest cosine
    cs = ConceptSet(centres, "s", method="kmeans", mean=mean)
    z = set_reader(cs, "code")(x)
    torch.testing.assert_close(z, F.one_hot(torch.cdist(x, centres).argmin(1), 5).float())
    r = random_directions(5, 16, 3)
    expected = F.one_hot((F.normalize(x - mean, dim=1) @ r.T).argmax(1), 5).float()
    torch.testing.assert_close(control_reader(cs, 5, 3, "code")(x), expected)


def test_unknown_reading_is_named():
    rows = _rows(12, 8, torch.eye(8)[:3], 0)
    with pytest.raises(ValueError, match="'linear'.*activation, code"):
        topic_lines(rows, rows, {}, ["a", "b", "c"], reading="linear")


def test_planted_centres_win_when_read_by_their_codes():
    d = 64
    topics = F.normalize(torch.randn(3, d, generator=torch.Generator().manual_seed(11)), dim=1)
    train, test = _rows(300, d, topics, 2), _rows(300, d, topics, 3)
    mean = train.x.mean(0)
    filler = torch.randn(13, d, generator=torch.Generator().manual_seed(4)) * 0.1
    planted = ConceptSet(torch.cat([2.0 * topics + mean, filler + mean]), "s", method="kmeans", mean=mean)
    lines = topic_lines(train, test, {"planted": planted}, ["a", "b", "c"], k=1, draws=3, reading="code")
    assert all(verdict(ln) == "wins" for ln in lines), [(ln.value, ln.baselines[0][1]) for ln in lines]
