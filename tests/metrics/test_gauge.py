import io

import pytest
import torch
from sklearn.decomposition import PCA

from conceptlens.metrics.gauge import (
    QueryKeyMoments,
    key_cosine,
    key_distance,
    key_norm,
    key_pca_explained,
    qk_singular_values,
    qk_spectrum,
    score_cosine,
)


def _qk(n, h, h_kv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g)  # correlated, uncentred queries
    q = torch.randn(n, h, d, generator=g) @ mix + 0.5
    k = torch.randn(n, h_kv, d, generator=g)
    return q, k


def _streamed(q, k, chunks=3):
    m = QueryKeyMoments()
    for qc, kc in zip(q.chunk(chunks), k.chunk(chunks)):
        m.update(qc, kc)
    return m


@pytest.mark.parametrize("h,h_kv", [(4, 4), (6, 2)])
def test_key_distance_is_mean_squared_score_change(h, h_kv):
    n, d = 300, 8
    q, k = _qk(n, h, h_kv, d)
    m = _streamed(q, k)
    k1, k2 = k[:50], k[50:100]  # (50, H_kv, d)
    g = h // h_kv
    # direct: for key head j, sum over its query heads of the mean over tokens of the squared change
    q_grouped = q.double().view(n, h_kv, g, d)
    change = torch.einsum("njgd,pjd->npjg", q_grouped, (k1 - k2).double())  # (n, pairs, H_kv, g)
    direct = (change**2).mean(0).sum(-1) / d
    got = key_distance(k1, k2, m.S_q)
    torch.testing.assert_close(got, direct, rtol=1e-5, atol=0)
    if g > 1:  # = g times the mean over all (token, query head) pairs of the group
        torch.testing.assert_close(got, g * (change**2).mean((0, 3)) / d, rtol=1e-5, atol=0)


def test_score_cosine_is_score_correlation():
    q, k = _qk(200, 6, 3, 8, seed=1)
    m = _streamed(q, k)
    k1, k2 = k[:20].double(), k[20:40].double()
    qg = q.double().view(200, 3, 2, 8)
    s1 = torch.einsum("njgd,pjd->npjg", qg, k1)
    s2 = torch.einsum("njgd,pjd->npjg", qg, k2)
    direct = (s1 * s2).mean(0).sum(-1) / ((s1**2).mean(0).sum(-1) * (s2**2).mean(0).sum(-1)).sqrt()
    torch.testing.assert_close(score_cosine(k1, k2, m.S_q), direct, rtol=1e-6, atol=1e-9)


def test_streaming_equals_full_batch_and_merge_is_exact():
    q, k = _qk(240, 6, 2, 8, seed=2)
    full = QueryKeyMoments()
    full.update(q, k)
    streamed = _streamed(q, k, chunks=4)
    for name in ("S_q", "S_q_per_head", "S_k", "mean_q", "mean_k"):
        torch.testing.assert_close(getattr(streamed, name), getattr(full, name), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(full.mean_q, q.double().mean(0))
    torch.testing.assert_close(full.S_k, torch.einsum("nha,nhb->hab", k.double(), k.double()) / 240)

    one_run = QueryKeyMoments()
    a, b = QueryKeyMoments(), QueryKeyMoments()
    one_run.update(q[:100], k[:100])
    one_run.update(q[100:], k[100:])
    a.update(q[:100], k[:100])
    b.update(q[100:], k[100:])
    a.merge(b)
    for key, value in one_run.state_dict().items():
        assert torch.equal(a.state_dict()[key], value) if torch.is_tensor(value) else a.state_dict()[key] == value


def test_state_dict_round_trip_through_torch_save():
    q, k = _qk(90, 4, 2, 8, seed=3)
    m = _streamed(q[:60], k[:60])
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    resumed = QueryKeyMoments()
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    resumed.update(q[60:], k[60:])
    m.update(q[60:], k[60:])
    assert torch.equal(resumed.S_q, m.S_q) and resumed.n_q == m.n_q == 90


def test_cross_attention_counts_and_shape_errors():
    m = QueryKeyMoments(n_kv_heads=2)
    m.update(torch.randn(5, 4, 8), torch.randn(7, 2, 8))
    assert (m.n_q, m.n_k) == (5, 7)
    with pytest.raises(ValueError, match="n_kv_heads=2"):
        m.update(torch.randn(5, 4, 8), torch.randn(5, 4, 8))
    with pytest.raises(ValueError, match="multiple of key heads"):
        QueryKeyMoments().update(torch.randn(5, 3, 8), torch.randn(5, 2, 8))
    with pytest.raises(ValueError, match="earlier batches"):
        m.update(torch.randn(5, 4, 6), torch.randn(5, 2, 6))
    with pytest.raises(RuntimeError, match="no data"):
        QueryKeyMoments().S_q


def _random_gauge(h_kv, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(h_kv, d, d, generator=g, dtype=torch.float64) + 3 * torch.eye(d, dtype=torch.float64)


def test_invariant_metrics_do_not_move_under_a_gauge_and_raw_ones_do():
    q, k = _qk(400, 4, 2, 8, seed=4)
    q, k = q.double(), k.double()
    A = _random_gauge(2, 8, seed=5)
    A_inv_t = torch.linalg.inv(A).transpose(-1, -2)
    q2 = torch.einsum("jab,njgb->njga", A, q.view(400, 2, 2, 8)).reshape(400, 4, 8)
    k2 = torch.einsum("jab,njb->nja", A_inv_t, k)
    m, m2 = _streamed(q, k), _streamed(q2, k2)
    pairs = (slice(0, 30), slice(30, 60))
    for f in (key_distance, score_cosine):
        torch.testing.assert_close(f(k2[pairs[0]], k2[pairs[1]], m2.S_q), f(k[pairs[0]], k[pairs[1]], m.S_q))
    torch.testing.assert_close(qk_spectrum(m2.S_q, m2.S_k), qk_spectrum(m.S_q, m.S_k))
    assert not torch.allclose(key_norm(k2), key_norm(k), rtol=1e-2)
    assert not torch.allclose(key_cosine(k2[:30], k2[30:60]), key_cosine(k[:30], k[30:60]), atol=1e-2)


def test_qk_spectrum_equals_eigenvalues_of_product():
    q, k = _qk(300, 2, 2, 6, seed=6)
    m = _streamed(q, k)
    direct = torch.linalg.eigvals(m.S_q @ m.S_k).real.sort(-1, descending=True).values
    torch.testing.assert_close(qk_spectrum(m.S_q, m.S_k), direct, rtol=1e-8, atol=1e-8)


def test_qk_singular_values_match_full_product_and_are_invariant():
    g = torch.Generator().manual_seed(7)
    W_q, W_k = torch.randn(3, 4, 16, generator=g).double(), torch.randn(3, 4, 16, generator=g).double()
    direct = torch.linalg.svdvals(W_q.transpose(-1, -2) @ W_k)[:, :4]
    torch.testing.assert_close(qk_singular_values(W_q, W_k), direct)
    A = _random_gauge(3, 4, seed=8)
    gauged = qk_singular_values(A @ W_q, torch.linalg.inv(A).transpose(-1, -2) @ W_k)
    torch.testing.assert_close(gauged, direct)


def test_key_pca_explained_matches_sklearn():
    _, k = _qk(100, 2, 3, 8, seed=9)
    k = k * torch.linspace(0.2, 3, 8)
    got = key_pca_explained(k, r=3)
    for head in range(3):
        ref = PCA(n_components=3).fit(k[:, head].numpy()).explained_variance_ratio_
        torch.testing.assert_close(got[head], torch.as_tensor(ref, dtype=got.dtype), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="r must be"):
        key_pca_explained(k, r=9)
