import math

import numpy as np
import pytest
import torch
from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import log_loss

from conceptlens.metrics.quality import (
    best_latent_f1,
    ce_loss_recovered,
    dead_fraction,
    effective_rank,
    fit_logistic_1d,
    fvu,
    l0,
    lda_directions,
    max_pairwise_cosine,
    mppc,
    probe_loss,
    standardised_probe_loss,
)


def _labelled(n=240, n_concepts=6, n_classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, n_classes, (n,), generator=g)
    z = torch.randn(n, n_concepts, generator=g)
    z[:, 1] += 1.5 * (y == 0)  # concept 1 marks class 0, concept 3 marks class 2 (weakly)
    z[:, 3] += 0.8 * (y == 2)
    z[:, 4] = torch.relu(z[:, 4])  # sparse-ish
    z[:, 5] = 0.0  # a dead concept
    return z, y


def _sklearn_fit(x, y, C=1.0):
    return LogisticRegression(C=C, solver="newton-cholesky", tol=1e-12, max_iter=1000).fit(np.asarray(x, dtype=np.float64).reshape(-1, 1), y)


def test_logistic_newton_equals_sklearn_per_column():
    z, y = _labelled()
    yb = (y == 0).long()
    z[:, 2] = 10 * (yb - 0.5) + 0.1 * z[:, 2]  # (nearly) separable column: the penalty keeps w finite
    w, b = fit_logistic_1d(z, yb, C=0.5)
    for j in range(z.shape[1]):
        ref = _sklearn_fit(z[:, j].numpy(), yb.numpy(), C=0.5)
        assert w[j].item() == pytest.approx(ref.coef_[0, 0], rel=1e-5, abs=1e-7)
        assert b[j].item() == pytest.approx(ref.intercept_[0], rel=1e-5, abs=1e-7)
    with pytest.raises(ValueError, match="C must be"):
        fit_logistic_1d(z, yb, C=math.inf)


def _sklearn_probe_loss(z_tr, y_tr, z_te, y_te):
    """The released probes' computation, by hand: per class and concept sklearn's LogisticRegression (C 1)
    on the raw 1-D activations; the lowest train log-loss picks the concept, its test log-loss counts."""
    expected, best = [], []
    for c in range(3):
        yc_tr, yc_te = (y_tr == c).numpy(), (y_te == c).numpy()
        fits = [_sklearn_fit(z_tr[:, j].numpy(), yc_tr) for j in range(z_tr.shape[1])]
        train = [log_loss(yc_tr, f.predict_proba(z_tr[:, j].numpy().reshape(-1, 1))) for j, f in enumerate(fits)]
        j = int(np.argmin(train))
        best.append(j)
        expected.append(log_loss(yc_te, fits[j].predict_proba(z_te[:, j].numpy().reshape(-1, 1)), labels=[0, 1]))
    return expected, best


@pytest.mark.parametrize("scale", [1.0, 0.01])  # activations of a cosine's scale: the penalty then counts
def test_probe_loss_equals_the_released_probes_on_raw_activations(scale):
    z, y = _labelled(seed=1)
    z = z * scale
    z_tr, y_tr, z_te, y_te = z[:160], y[:160], z[160:], y[160:]
    result = probe_loss(z_tr, y_tr, z_te, y_te)
    expected, best = _sklearn_probe_loss(z_tr.double(), y_tr, z_te.double(), y_te)
    assert result.best_concept.tolist() == best
    if scale == 1.0:
        assert best[0] == 1 and best[2] == 3  # the planted concepts win
    np.testing.assert_allclose(result.per_class.numpy(), expected, rtol=1e-5)
    assert result.loss == pytest.approx(float(np.median(expected)), rel=1e-5)
    assert result.classes.tolist() == [0, 1, 2]


def test_standardised_probe_loss_is_the_released_probes_on_standardised_columns():
    from sklearn.preprocessing import StandardScaler

    z, y = _labelled(seed=1)
    z = z * 0.01
    z_tr, y_tr, z_te, y_te = z[:160], y[:160], z[160:], y[160:]
    result = standardised_probe_loss(z_tr, y_tr, z_te, y_te)
    scaler = StandardScaler().fit(z_tr.double().numpy())
    expected, best = _sklearn_probe_loss(*(torch.from_numpy(scaler.transform(t.double().numpy())) if i % 2 == 0 else t
                                           for i, t in enumerate((z_tr, y_tr, z_te, y_te))))
    assert result.best_concept.tolist() == best
    np.testing.assert_allclose(result.per_class.numpy(), expected, rtol=1e-5)
    raw = probe_loss(z_tr, y_tr, z_te, y_te)  # the paper's value differs at this scale: the penalty counts
    assert (raw.per_class - result.per_class).abs().max() > 0.01


def test_probe_loss_leaves_out_a_label_missing_from_the_test_split():
    z, y = _labelled(seed=1)
    z_tr, y_tr, z_te, y_te = z[:160], y[:160], z[160:], y[160:]
    keep = y_te != 2  # no test row of class 2
    full, partial = probe_loss(z_tr, y_tr, z_te, y_te), probe_loss(z_tr, y_tr, z_te[keep], y_te[keep])
    assert partial.classes.tolist() == [0, 1]
    assert partial.best_concept.tolist() == full.best_concept[:2].tolist()  # the same train fits
    assert len(partial.per_class) == 2 and partial.loss == pytest.approx(float(partial.per_class.mean()))
    with pytest.raises(ValueError, match="appears in y_test"):
        probe_loss(z_tr, y_tr, z_te[:5], torch.full((5,), 7))


def test_standardised_probe_loss_does_not_depend_on_the_scale_of_a_concept():
    z, y = _labelled(seed=3)
    scaled = z * torch.tensor([0.001, 0.01, 1.0, 30.0, 1.0, 0.5])  # cosines are ~100x smaller than projections
    a = standardised_probe_loss(z[:160], y[:160], z[160:], y[160:])
    b = standardised_probe_loss(scaled[:160], y[:160], scaled[160:], y[160:])
    assert a.best_concept.tolist() == b.best_concept.tolist()
    torch.testing.assert_close(a.per_class, b.per_class, rtol=1e-6, atol=1e-9)


def test_probe_loss_binary_and_chunking(monkeypatch):
    import conceptlens.metrics.quality as quality

    z, y = _labelled(n_classes=2, seed=2)
    full = probe_loss(z[:150], y[:150], z[150:], y[150:])
    assert full.per_class[0].item() == pytest.approx(full.per_class[1].item(), rel=1e-6)  # symmetric one-vs-rest
    monkeypatch.setattr(quality, "_CHUNK_ELEMENTS", 2 * 150)  # two concepts per chunk
    chunked = probe_loss(z[:150], y[:150], z[150:], y[150:])
    assert chunked.best_concept.tolist() == full.best_concept.tolist()
    assert chunked.loss == pytest.approx(full.loss, rel=1e-9)
    with pytest.raises(ValueError, match="at least two"):
        probe_loss(z, torch.zeros(len(z)), z, y)


def test_mppc_self_is_one_and_matches_brute_force():
    g = torch.Generator().manual_seed(3)
    z_a = torch.relu(torch.randn(300, 8, generator=g))
    assert mppc(z_a, z_a) == pytest.approx(1.0, abs=1e-12)
    copy = 3.0 * z_a[:, torch.randperm(8, generator=g)] + 1.0  # permuted, rescaled, shifted
    assert mppc(z_a, copy) == pytest.approx(1.0, abs=1e-12)
    z_b = z_a @ torch.randn(8, 5, generator=g) + torch.randn(300, 5, generator=g)
    corr = np.corrcoef(z_a.numpy().T, z_b.numpy().T)[:8, 8:]  # R_ij: concept i of run a, j of run b
    assert mppc(z_a, z_b) == pytest.approx(corr.max(0).mean(), rel=1e-6)  # mean_j max_i R_ij (the paper's)
    assert mppc(z_b, z_a) == pytest.approx(corr.max(1).mean(), rel=1e-6)
    assert corr.max(0).mean() != pytest.approx(corr.max(1).mean(), abs=0.01)  # the axes differ here
    with_dead = torch.cat([z_a, torch.zeros(300, 1)], 1)
    assert mppc(with_dead, with_dead) == pytest.approx(8 / 9, abs=1e-12)  # a constant concept counts 0
    many = torch.cat([z_a, torch.relu(torch.randn(300, 24, generator=g))], 1)  # run a: b's 8 and 24 others
    assert mppc(many, z_a) == pytest.approx(1.0, abs=1e-12)  # every concept of b is found in a
    with pytest.raises(ValueError, match="same tokens"):
        mppc(z_a, z_a[:10])


def test_effective_rank_and_max_pairwise_cosine():
    eye = torch.eye(5)[:3] * torch.tensor([[1.0], [2.0], [3.0]])
    s = np.array([3.0, 2.0, 1.0]) / 6
    assert effective_rank(eye) == pytest.approx(math.exp(-(s * np.log(s)).sum()), rel=1e-12)
    assert effective_rank(torch.eye(4)) == pytest.approx(4.0)
    assert effective_rank(torch.ones(6, 3)) == pytest.approx(1.0)
    g = torch.Generator().manual_seed(4)
    d = torch.randn(7, 5, generator=g)
    unit = d / d.norm(dim=1, keepdim=True)
    brute = [max(float(unit[i] @ unit[j]) for j in range(7) if j != i) for i in range(7)]
    np.testing.assert_allclose(max_pairwise_cosine(d).numpy(), brute, rtol=1e-6)


def test_reconstruction_and_sparsity_metrics_by_hand():
    x = torch.tensor([[1.0, 0.0], [3.0, 2.0]])  # mean (2, 1): total variance 1+1+1+1 = 4
    x_hat = torch.tensor([[1.0, 1.0], [3.0, 2.0]])  # squared error 1
    assert fvu(x, x_hat) == pytest.approx(0.25)
    z = torch.tensor([[0.0, 2.0, 0.0, 1.0], [0.0, 0.0, 0.0, 3.0], [0.0, -1.0, 0.0, 0.0]])
    assert l0(z) == pytest.approx(4 / 3)
    assert dead_fraction(z) == pytest.approx(0.5)
    assert ce_loss_recovered(clean=2.0, spliced=2.5, zero_ablated=7.0) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="undefined"):
        ce_loss_recovered(2.0, 2.5, 2.0)


@pytest.mark.parametrize("shrinkage", [0.0, 0.3])
def test_lda_directions_match_sklearn_one_vs_rest(shrinkage):
    g = torch.Generator().manual_seed(5)
    y = torch.randint(0, 3, (400,), generator=g)
    means = torch.randn(3, 6, generator=g) * 2
    x = means[y] + torch.randn(400, 6, generator=g) @ torch.randn(6, 6, generator=g)
    got = lda_directions(x, y, shrinkage=shrinkage)
    for c in range(3):
        lda = LinearDiscriminantAnalysis(solver="lsqr", shrinkage=shrinkage).fit(x.double().numpy(), (y == c).numpy())
        ref = lda.coef_[0] / np.linalg.norm(lda.coef_[0])
        np.testing.assert_allclose(got.directions[c].numpy(), ref, rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="shrinkage must be"):
        lda_directions(x, y, shrinkage=2.0)


def test_best_latent_f1_by_hand():
    # 6 tokens, 2 concepts, 3 latents. Concept 0 = tokens 0-2, concept 1 = tokens 3-5.
    labels = torch.tensor([0, 0, 0, 1, 1, 1])
    z = torch.tensor([[1.0, 0, 0], [1, 0, 0], [0, 0, 2], [1, 3, 0], [0, 3, 0], [0, 0, 0]])
    # concept 0: latent 0 fires on 0, 1, 3 -> P 2/3, R 2/3, F1 2/3; latent 2 on 2 -> P 1, R 1/3, F1 1/2
    # concept 1: latent 1 fires on 3, 4 -> P 1, R 2/3, F1 0.8; latent 0 -> P 1/3, R 1/3
    torch.testing.assert_close(best_latent_f1(z, labels), torch.tensor([2 / 3, 0.8]))
