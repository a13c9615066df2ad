"""Representation similarity measures against textbook formulas and library references, and the group audit."""

import warnings

import numpy as np
import pytest
import torch
from scipy.linalg import orthogonal_procrustes
from sklearn.neighbors import NearestNeighbors

from conceptlens.metrics.gauge_sites import GaugeWarning
from conceptlens.metrics.similarity import (MEASURES, cca, group_audit, linear_cka, mutual_knn, procrustes,
                                            random_element, similarity, svcca)


def _pair(n=120, dx=6, dy=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dx, generator=g, dtype=torch.float64)
    y = x[:, :dy] @ torch.randn(dy, dy, generator=g, dtype=torch.float64) + 0.5 * torch.randn(n, dy, generator=g,
                                                                                             dtype=torch.float64)
    return x, y


def test_linear_cka_equals_the_hsic_formula():
    x, y = _pair()
    H = torch.eye(len(x), dtype=torch.float64) - 1 / len(x)
    K, L = H @ x @ x.T @ H, H @ y @ y.T @ H
    want = (K * L).sum() / torch.sqrt((K * K).sum() * (L * L).sum())
    assert linear_cka(x, y) == pytest.approx(float(want), rel=1e-10)
    assert linear_cka(x, x) == pytest.approx(1.0)


def test_cca_equals_the_covariance_eigenproblem_and_svcca_at_full_variance():
    x, y = _pair()
    xc, yc = x - x.mean(0), y - y.mean(0)
    Sxx, Syy, Sxy = xc.T @ xc, yc.T @ yc, xc.T @ yc
    rho2 = torch.linalg.eigvals(torch.linalg.solve(Syy, Sxy.T) @ torch.linalg.solve(Sxx, Sxy)).real
    assert cca(x, y) == pytest.approx(float(rho2.clamp_min(0).sqrt().mean()), rel=1e-8)
    assert svcca(x, y, keep=1.0) == pytest.approx(cca(x, y), rel=1e-10)
    assert svcca(x, y, keep=0.5) != pytest.approx(cca(x, y), rel=1e-3)  # fewer directions kept


def test_procrustes_matches_scipy_and_knn_matches_sklearn():
    x, y = _pair(dx=5, dy=5)
    xn = (x - x.mean(0)).numpy(); yn = (y - y.mean(0)).numpy()
    xn, yn = xn / np.linalg.norm(xn), yn / np.linalg.norm(yn)
    _, nuclear = orthogonal_procrustes(yn, xn)
    assert procrustes(x, y) == pytest.approx(nuclear, rel=1e-10)
    k = 7
    nx_ = NearestNeighbors(n_neighbors=k + 1).fit(x.numpy()).kneighbors(x.numpy(), return_distance=False)[:, 1:]
    ny_ = NearestNeighbors(n_neighbors=k + 1).fit(y.numpy()).kneighbors(y.numpy(), return_distance=False)[:, 1:]
    want = np.mean([len(set(a) & set(b)) / k for a, b in zip(nx_, ny_)])
    assert mutual_knn(x, y, k=k) == pytest.approx(want)
    with pytest.raises(ValueError, match="k must be in 1..N-1=119; got 0"):
        mutual_knn(x, y, k=0)


def test_random_elements_belong_to_their_group():
    g = torch.Generator().manual_seed(1)
    Q, _ = random_element("isometry", 4, g)
    torch.testing.assert_close(Q @ Q.T, torch.eye(4, dtype=torch.float64))
    S, _ = random_element("similarity", 4, g)
    s = torch.linalg.svdvals(S)
    torch.testing.assert_close(s, s[0].expand(4))  # one scale
    A, _ = random_element("affine", 4, g)
    sv = torch.linalg.svdvals(A)
    assert sv.max() / sv.min() > 1.5 and sv.min() >= 0.25 - 1e-9
    with pytest.raises(ValueError, match="unknown group 'gl'"):
        random_element("gl", 4, g)


def test_group_audit_reports_what_moved():
    x, y = _pair()
    report = group_audit(x, y, trials=4, seed=3)
    assert report.consistent, str(report)
    for m in ("linear_cka", "svcca", "procrustes", "mutual_knn"):
        assert not report.moved(m, "isometry") and not report.moved(m, "similarity")
        assert report.moved(m, "affine"), m  # only similarity-invariant: an affine element moves them
    assert not any(report.moved("cca", g) for g in ("isometry", "similarity", "affine"))
    text = str(report)
    assert "MOVED" in text and "cca" in text
    assert {m.invariant_to for m in MEASURES.values()} == {"similarity", "affine"}


def test_similarity_dispatch_errors_and_qk_warning():
    x, y = _pair()
    assert similarity(x, y, "cca") == pytest.approx(cca(x, y))
    with pytest.raises(ValueError, match="unknown measure 'cos'; choose from"):
        similarity(x, y, "cos")
    with pytest.raises(ValueError, match="same N"):
        similarity(x, y[:10])
    with pytest.warns(GaugeWarning, match="linear_cka at the k site 'blocks.2.attn.k'"):
        similarity(x, y, "linear_cka", sites=("blocks.2.attn.k", "blocks.2.resid_out"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        similarity(x, y, "cca", sites=("blocks.2.attn.k", "blocks.2.attn.q"))  # GL-invariant: no warning
        similarity(x, y, "linear_cka", sites=("blocks.2.resid_out", "blocks.3.resid_out"))
