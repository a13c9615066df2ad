"""The probes' two readings: sets and their matched controls read alike, the code-reading probe against
scikit-learn on hand-built TopK codes, and the random TopK encoder matched in count."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler

from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.evaluate.activations import concept_encoder, pool_documents
from conceptlens.evaluate.lines import verdict
from conceptlens.evaluate.probing import probing_lines, random_directions
from conceptlens.evaluate.readings import column, control_reader, probe_readers, set_reader


def _sae_set(n: int, d: int, k: int, seed: int) -> ConceptSet:
    g = torch.Generator().manual_seed(seed)
    enc = {"W_enc": torch.randn(d, n, generator=g), "b_enc": torch.randn(n, generator=g),
           "b_dec": torch.randn(d, generator=g)}
    return ConceptSet(torch.randn(n, d, generator=g), "s", method="topk", encoder=enc, config={"width": n, "k": k})


def _tokens(n_docs: int, d: int, signal: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Documents of 5 tokens, half of each class (so the balanced task keeps every document); class-1
    tokens are shifted along `signal`."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n_docs) % 2
    doc = torch.arange(n_docs).repeat_interleave(5)
    return torch.randn(len(doc), d, generator=g) + 1.5 * y[doc, None] * signal, doc, y


def _hand_probe_accuracy(code, x_train, x_test, doc_train, doc_test, y_train, y_test, k):
    """Per-token codes by `code`, mean-pooled per document, the k largest |mean difference| columns,
    scikit-learn's standardised logistic regression: test accuracy and the chosen columns."""
    pool = lambda z, doc, n: np.stack([z[doc == i].mean(0) for i in range(n)])
    z_train = pool(code(x_train).double().numpy(), doc_train.numpy(), len(y_train))
    z_test = pool(code(x_test).double().numpy(), doc_test.numpy(), len(y_test))
    yn = y_train.numpy()
    cols = np.argsort(-np.abs(z_train[yn == 1].mean(0) - z_train[yn == 0].mean(0)))[:k]
    scaler = StandardScaler().fit(z_train[:, cols])
    model = LogisticRegression(C=1.0, max_iter=1000).fit(scaler.transform(z_train[:, cols]), yn)
    return float((model.predict(scaler.transform(z_test[:, cols])) == y_test.numpy()).mean()), sorted(cols.tolist())


def test_code_probe_and_its_random_topk_control_equal_sklearn_on_hand_built_codes():
    n, d, k_sae, k_probe, draws = 24, 8, 4, 2, 2
    cs = _sae_set(n, d, k_sae, 0)
    signal = F.normalize(cs.encoder["W_enc"][:, 3], dim=0)  # latent 3 reads the class
    (x_tr, doc_tr, y_tr), (x_te, doc_te, y_te) = _tokens(80, d, signal, 1), _tokens(60, d, signal, 2)
    readers = probe_readers({"sae": cs}, ("code",), draws=draws, seed=0)
    train, test = pool_documents(readers, x_tr, doc_tr, y_tr), pool_documents(readers, x_te, doc_te, y_te)
    (line,) = probing_lines("toy", train, test, ["a", "b"], reading="code", ks=(k_probe,))

    W, b, b_dec = cs.encoder["W_enc"], cs.encoder["b_enc"], cs.encoder["b_dec"]
    def topk(pre, k):  # ReLU of the k largest pre-activations of each token, zeros elsewhere
        return torch.where(pre >= pre.topk(k, dim=1).values[:, -1:], pre.relu(), torch.zeros(()))
    expected, cols = _hand_probe_accuracy(lambda x: topk((x - b_dec) @ W + b, k_sae), x_tr, x_te, doc_tr, doc_te,
                                          y_tr, y_te, k_probe)
    assert line.value.value == pytest.approx(expected) and expected > 0.7, (expected, cols)
    controls = [_hand_probe_accuracy(lambda x, r=r: topk((x - b_dec) @ random_directions(n, d, 1 + r).T, k_sae),
                                     x_tr, x_te, doc_tr, doc_te, y_tr, y_te, k_probe)[0] for r in range(draws)]
    name, control = line.baselines[0]
    assert name == f"random {n} dirs, codes" and control.value == pytest.approx(np.mean(controls))
    assert line.metric == f"toy k={k_probe} accuracy, codes" and [b for b, _ in line.baselines[1:]] == [
        "diff-of-means", "full probe"]


def test_the_random_topk_control_is_matched_in_count_and_sparsity():
    cs = _sae_set(12, 8, 3, 0)
    x = torch.randn(40, 8, generator=torch.Generator().manual_seed(1))
    for r in range(3):
        z = control_reader(cs, 1 + r, "code")(x)
        assert z.shape == (40, len(cs)) and int((z > 0).sum(1).max()) <= 3 and int((z > 0).sum(1).min()) >= 1
    readers = probe_readers({"sae": cs}, ("code",), draws=3, seed=0)
    assert sorted(readers) == sorted([column("sae", "code")] + [column("sae", "code", r) for r in range(3)])
    # the library's own TopK SAE with the random unit directions as its encoder, no encoder bias, the set's b_dec
    rand = random_directions(12, 8, 5)
    random_sae = ConceptSet(rand, "s", method="topk", config={"width": 12, "k": 3},
                            encoder={"W_enc": rand.T.contiguous(), "b_enc": torch.zeros(12), "b_dec": cs.encoder["b_dec"]})
    torch.testing.assert_close(control_reader(cs, 5, "code")(x), concept_encoder(random_sae).encode(x))
    torch.testing.assert_close(set_reader(cs, "code")(x), concept_encoder(cs).encode(x))  # an SAE's code: its encoder


def test_activation_control_is_read_as_the_set_is():
    g = torch.Generator().manual_seed(0)
    x, mean = torch.randn(50, 16, generator=g), torch.randn(16, generator=g)
    dense = ConceptSet(torch.randn(4, 16, generator=g), "s", method="kmeans", mean=mean)
    r = random_directions(4, 16, 7)
    expected = F.normalize(x - mean, dim=1) @ r.T  # cosine to the random direction, centred on the set's mean
    torch.testing.assert_close(control_reader(dense, 7)(x), expected)
    plain = ConceptSet(torch.randn(4, 16, generator=g), "s", method="random")  # no mean: the projection
    torch.testing.assert_close(control_reader(plain, 7)(x), x @ r.T)


def test_a_set_of_random_directions_is_read_exactly_as_its_control():
    """A difference set's directions lose their component along the mean when centred, and so do its
    control's: a set of the control's own random directions reads as the control does, however large
    the mean (one massive coordinate here, as on Gemma-3); a k-means set's control keeps its directions."""
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(16, generator=g)
    mean[3] = 300.0
    x = mean + 3 * torch.randn(50, 16, generator=g)
    x[:, 3] += 40 * torch.randn(50, generator=g)  # the massive coordinate also varies most
    r = random_directions(6, 16, 7)
    for method in ("random", "deleuzian"):
        cs = ConceptSet(r, "s", method=method, mean=mean)
        for reading in ("activation", "code"):
            torch.testing.assert_close(control_reader(cs, 7, reading)(x), set_reader(cs, reading)(x))
    m = F.normalize(mean, dim=0)
    by_hand = F.normalize(x - mean, dim=1) @ F.normalize(r - (r @ m)[:, None] * m, dim=1).T
    torch.testing.assert_close(control_reader(ConceptSet(r, "s", method="deleuzian", mean=mean), 7)(x), by_hand)
    kmeans = ConceptSet(torch.randn(6, 16, generator=g) + mean, "s", method="kmeans", mean=mean)
    torch.testing.assert_close(control_reader(kmeans, 7)(x), F.normalize(x - mean, dim=1) @ r.T)
    readers = probe_readers({"d": ConceptSet(r, "s", method="deleuzian", mean=mean), "k": kmeans}, draws=1)
    assert readers[column("d", "activation", 0)] is not readers[column("k", "activation", 0)]  # centred apart


def test_code_reading_assigns_dense_sets_their_nearest_centre_and_the_control_its_largest_cosine():
    g = torch.Generator().manual_seed(0)
    x, mean = torch.randn(60, 16, generator=g), torch.randn(16, generator=g)
    centres = torch.randn(5, 16, generator=g) * torch.linspace(0.6, 1.4, 5)[:, None]  # unequal norms: nearest is not
    cs = ConceptSet(centres, "s", method="kmeans", mean=mean)                          # the largest cosine
    torch.testing.assert_close(set_reader(cs, "code")(x), F.one_hot(torch.cdist(x, centres).argmin(1), 5).float())
    expected = F.one_hot((F.normalize(x - mean, dim=1) @ random_directions(5, 16, 3).T).argmax(1), 5).float()
    torch.testing.assert_close(control_reader(cs, 3, "code")(x), expected)


def test_planted_centres_win_when_read_by_their_codes():
    d = 64
    topics = F.normalize(torch.randn(3, d, generator=torch.Generator().manual_seed(11)), dim=1)

    def tokens(seed):
        g = torch.Generator().manual_seed(seed)
        y = torch.randint(3, (300,), generator=g)
        doc = torch.arange(300).repeat_interleave(6)
        return torch.randn(len(doc), d, generator=g) + 2.0 * topics[y[doc]] + 5.0, doc, y

    (x, doc, y), test_tokens = tokens(2), tokens(3)
    mean = x.mean(0)
    filler = torch.randn(13, d, generator=torch.Generator().manual_seed(4)) * 0.1
    planted = ConceptSet(torch.cat([2.0 * topics + mean, filler + mean]), "s", method="kmeans", mean=mean)
    readers = probe_readers({"planted": planted}, ("code",), draws=3)
    train, test = pool_documents(readers, x, doc, y), pool_documents(readers, *test_tokens)
    lines = probing_lines("toy", train, test, ["a", "b", "c"], reading="code", ks=(1,), by_task=True)
    assert [ln.metric for ln in lines] == ["a k=1 accuracy, codes", "b k=1 accuracy, codes", "c k=1 accuracy, codes"]
    assert all(verdict(ln) == "wins" for ln in lines), [(ln.value, ln.baselines[0][1]) for ln in lines]


def test_unknown_reading_is_named():
    with pytest.raises(ValueError, match="'linear'.*activation, code"):
        probe_readers({}, ("linear",), draws=1)


def test_a_set_name_with_a_slash_is_refused_not_dropped():
    cs = ConceptSet(torch.eye(4), "blocks.0.resid_out", method="kmeans", mean=torch.zeros(4))
    assert column("run_topk") in probe_readers({"run_topk": cs}, draws=1)
    with pytest.raises(ValueError, match="'run/topk' holds a '/'"):
        probe_readers({"run/topk": cs}, draws=1)
