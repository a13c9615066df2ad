"""Deleuzian's paper mode against the released code's formulas (skewness over all samples,
1/|g| weights, weighted k-means), resume and merge."""

import io

import numpy as np
import pytest
import torch
from sklearn.cluster import KMeans

from conceptlens.concepts.deleuzian import Deleuzian
from conceptlens.concepts.deleuzian_paper import orient_and_weight, skewness_with_endpoints
from conceptlens.concepts.kmeans import kmeans_plusplus
from tests.conftest import assert_same_state


def released_skew(acts, diffs):
    """The released code's formula: P = acts @ diffs.T over all samples, population std + 1e-20."""
    P = (acts.double() @ diffs.double().T).T
    mean, std = P.mean(1, keepdim=True), P.std(1, unbiased=False, keepdim=True) + 1e-20
    return (((P - mean) / std) ** 3).mean(1)


def _data(n=300, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).relu() * torch.rand(n, 1, generator=g) * 3
    x[:5] *= 12  # a few outlier tokens
    return x


def test_skewness_without_the_endpoints_needs_exact():
    x = _data()
    diff = x[:3] - x[3:6]
    with pytest.raises(ValueError, match="p_a and p_b unless exact=True"):
        skewness_with_endpoints(x, diff, None, None, len(x) + 2)


def test_skewness_with_endpoints_is_the_skewness_over_all_samples():
    x = _data()
    a, b = torch.tensor([0, 7, 30]), torch.tensor([9, 1, 2])
    diff = x[a] - x[b]
    want = released_skew(x, diff)
    torch.testing.assert_close(skewness_with_endpoints(x, diff, None, None, len(x), exact=True), want)
    for i in range(3):  # the reference holds everything but this difference's endpoints
        keep = torch.ones(len(x), dtype=torch.bool)
        keep[torch.stack([a[i], b[i]])] = False
        got = skewness_with_endpoints(x[keep], diff[i:i + 1], (x[a[i]] @ diff[i])[None], (x[b[i]] @ diff[i])[None],
                                      len(x))
        torch.testing.assert_close(got, want[i:i + 1])
    # the endpoint matters: one outlier token, and the difference that touches it
    y = torch.randn(300, 6, generator=torch.Generator().manual_seed(3)).relu()
    y[0, 0] = 40.0
    d = (y[0] - y[9])[None]
    keep = torch.ones(len(y), dtype=torch.bool)
    keep[torch.tensor([0, 9])] = False
    over_all, without = released_skew(y, d), released_skew(y[keep], d)
    assert over_all.abs() > 10 and without.abs() < 3  # weight 1/|g|: tiny with the endpoint, large without
    torch.testing.assert_close(skewness_with_endpoints(y[keep], d, y[0] @ d[0, None].T, y[9] @ d[0, None].T, 300),
                               over_all)


def test_skewness_in_column_chunks_equals_one_block():
    x = _data()
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(len(x), (50,), generator=g), torch.randint(len(x), (50,), generator=g)
    diff = x[a] - x[b]
    p_a, p_b = (x[a] * diff).sum(1), (x[b] * diff).sum(1)
    for exact, args in ((True, (None, None)), (False, (p_a, p_b))):
        whole = skewness_with_endpoints(x, diff, *args, len(x) + 2, exact=exact)
        chunked = skewness_with_endpoints(x, diff, *args, len(x) + 2, exact=exact, chunk_elements=7 * len(x))
        torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)  # float64 GEMM blocking
        assert whole.shape == (50,)


def test_orientation_and_weights_follow_the_released_code():
    diff = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])
    g = torch.tensor([-2.0, 0.5, float("nan")])
    oriented, w = orient_and_weight(diff, g, skew_weighting=True)
    torch.testing.assert_close(oriented[:2], torch.tensor([[-1.0, 0.0], [0.0, 2.0]]))
    assert w.tolist()[:2] == [0.5, 2.0] and w[2] == 0  # nan -> 0


def _fit(x, size=None, **kw):
    size = size or len(x)
    dz = Deleuzian(8, mode="paper", batch_size=64, buffer_size=128, reference_size=size, max_differences=size, **kw)
    for chunk in x.split(50):
        dz.update(chunk)
    return dz


def test_paper_mode_equals_weighted_kmeans_of_the_released_pipeline():
    x = _data()
    dz = _fit(x)
    dz.flush()
    diff, p_a, p_b = dz.differences.content()
    assert len(diff) == len(x)  # every row once on the left
    g = released_skew(x, diff)
    oriented = diff.double() * torch.sign(g)[:, None]
    w = torch.nan_to_num(1 / g.abs(), nan=0, posinf=0, neginf=0)
    # the same k-means++ start, then sklearn's Lloyd to convergence with the same weights
    init = oriented.float()[kmeans_plusplus(oriented.float(), 8, torch.Generator().manual_seed(2), w.float())]
    km = KMeans(8, init=init.double().numpy(), n_init=1, max_iter=300, tol=0).fit(
        oriented.numpy(), sample_weight=w.numpy())
    np.testing.assert_allclose(dz.centroids.numpy(), km.cluster_centers_, rtol=1e-4, atol=1e-4)
    assert dz.concept_set().stats["mass"].shape == (8,)
    torch.testing.assert_close(dz.encode(x[:3]), x[:3] @ dz.centroids.T)


def test_paper_mode_resumes_bit_identically_and_merges():
    x = _data(seed=1)
    whole = _fit(x)
    first = _fit(x[:150], size=len(x))
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = Deleuzian(8, mode="paper", batch_size=64, buffer_size=128, reference_size=len(x), max_differences=len(x))
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    for chunk in x[150:].split(50):
        resumed.update(chunk)
    assert_same_state(resumed.state_dict(), Deleuzian.from_state(whole.state_dict()).state_dict())
    torch.testing.assert_close(resumed.centroids, whole.centroids, rtol=0, atol=0)
    other = _fit(x[150:], size=len(x), seed=5)
    first.merge(other)
    first.flush()
    assert len(first.differences) == len(x) and first.centroids.shape == (8, 6)
    with pytest.raises(ValueError, match="mode must be one of"):
        Deleuzian(8, mode="fast")
