"""k-sparse probing against scikit-learn, its balanced tasks, and its controls on planted signal."""

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler

from conceptlens.evaluate.activations import Probed
from conceptlens.evaluate.lines import verdict
from conceptlens.evaluate.probing import binary_tasks, fit_sparse_probe, probing_lines, random_directions
from conceptlens.evaluate.readings import column


def test_sparse_probe_equals_sklearn_on_the_top_mean_difference_latents():
    g = torch.Generator().manual_seed(0)
    y = (torch.rand(300, generator=g) < 0.5).long()
    z = torch.relu(torch.randn(300, 40, generator=g))
    z[:, 7] += 1.5 * y  # the largest mean difference
    z[:, 3] -= 0.8 * y  # the second (negative differences count by size)
    z[:, 21] += 0.5 * y
    probe = fit_sparse_probe(z, y, k=2)
    zn, yn = z.double().numpy(), y.numpy()
    diff = np.abs(zn[yn == 1].mean(0) - zn[yn == 0].mean(0))
    expected = np.argsort(-diff)[:2]
    assert sorted(probe.features.tolist()) == sorted(expected.tolist()) == [3, 7]
    scaler = StandardScaler().fit(zn[:, probe.features.numpy()])
    reference = LogisticRegression(C=1.0, max_iter=1000).fit(scaler.transform(zn[:, probe.features.numpy()]), yn)
    fitted = probe.model[-1]
    np.testing.assert_allclose(fitted.coef_, reference.coef_, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(fitted.intercept_, reference.intercept_, rtol=1e-6, atol=1e-8)
    z_test = torch.relu(torch.randn(100, 40, generator=g))
    expected_pred = reference.predict(scaler.transform(z_test.double().numpy()[:, probe.features.numpy()]))
    assert probe.predict(z_test).tolist() == expected_pred.tolist()


def test_binary_tasks_are_balanced_one_vs_rest():
    y_train = torch.tensor([0] * 10 + [1] * 30 + [2] * 60)
    y_test = torch.tensor([0] * 5 + [1] * 5 + [2] * 10)
    tasks = binary_tasks(y_train, y_test, ["a", "b", "c"])
    assert [t.name for t in tasks] == ["a", "b", "c"]
    for t, (n_train, n_test) in zip(tasks, [(10, 5), (30, 5), (40, 10)]):
        assert int(t.y_train.sum()) == len(t.y_train) - int(t.y_train.sum()) == n_train
        assert int(t.y_test.sum()) == n_test and len(t.y_test) == 2 * n_test
        assert (y_test[t.test] == tasks.index(t)).long().tolist() == t.y_test.tolist()
    two = binary_tasks(torch.tensor([0, 1, 1, 0]), torch.tensor([1, 0]), ["neg", "pos"])
    assert [t.name for t in two] == ["pos"]  # a two-class set is one task


def test_a_tasks_train_rows_do_not_depend_on_the_test_split():
    y_train = torch.tensor([0] * 10 + [1] * 30 + [2] * 60)
    small, large = torch.tensor([0] * 5 + [1] * 5 + [2] * 10), torch.tensor([0] * 50 + [1] * 15 + [2] * 10)
    for a, b in zip(binary_tasks(y_train, small, ["a", "b", "c"]), binary_tasks(y_train, large, ["a", "b", "c"])):
        assert a.train.tolist() == b.train.tolist() and a.y_train.tolist() == b.y_train.tolist()


def _probed(seed: int, n: int = 240, draws: int = 3) -> Probed:
    """Documents of two classes: set 'planted' has latent 5 = class + small noise; x carries the class weakly.
    Its control columns: projections on 32 random directions (the activation reading of a set without a
    mean, as `readings.control_reader` draws them; linear, so reading pooled rows equals pooling read tokens)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    x = torch.randn(n, 16, generator=g)
    x[:, 0] += 0.3 * y
    z = torch.randn(n, 32, generator=g)
    z[:, 5] = y + 0.1 * torch.randn(n, generator=g)
    controls = {column("planted", "activation", r): x @ random_directions(32, 16, 1 + r).T for r in range(draws)}
    return Probed(x, {"planted": z, **controls}, y, torch.arange(n))


def test_probing_lines_put_a_planted_latent_above_its_matched_random_control():
    train, test = _probed(0), _probed(1)
    lines = probing_lines("toy", train, test, ["a", "b"], ks=(1, 5))
    assert [ln.metric for ln in lines] == ["toy k=1 accuracy", "toy k=5 accuracy"]
    k1 = lines[0]
    expected = fit_sparse_probe(train.z["planted"], train.y, 1).predict(test.z["planted"])
    assert k1.value.value == pytest.approx(float((expected == test.y).double().mean()))
    assert k1.value.low <= k1.value.value <= k1.value.high
    names = [name for name, _ in k1.baselines]
    assert names == ["random 32 dirs", "diff-of-means", "full probe"]
    assert k1.value.value > 0.95 and k1.baselines[0][1].high < 0.9 and verdict(k1) == "wins"
