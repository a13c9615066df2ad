"""Probe weights (covectors) and directions (vectors): conversions need an inner product."""

import warnings

import pytest
import torch

from conceptlens.metrics.duality import Direction, InnerProduct, ProbeWeight, direction_to_probe, probe_to_direction
from conceptlens.metrics.gauge_sites import GaugeWarning, is_qk_site
from conceptlens.metrics.quality import effective_rank, max_pairwise_cosine


def _data(seed=0, n=400, d=4):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g, dtype=torch.float64)
    return torch.randn(n, d, generator=g, dtype=torch.float64) @ mix.T, g


def test_conversion_reads_back_the_probe_and_round_trips():
    x, g = _data()
    w = ProbeWeight(torch.randn(4, generator=g, dtype=torch.float64), site="blocks.1.resid_out")
    for metric in (InnerProduct.identity(4), InnerProduct.covariance(x), InnerProduct.learned(torch.diag(
            torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)))):
        v = probe_to_direction(w, metric)
        assert isinstance(v, Direction) and v.metric == metric.name and v.site == "blocks.1.resid_out"
        # <v, x>_M = w . x for every x
        for row in x[:5]:
            assert float(metric(v, Direction(row))) == pytest.approx(float(w.read(row)), rel=1e-8)
        torch.testing.assert_close(direction_to_probe(v, metric).covector, w.covector)
    torch.testing.assert_close(probe_to_direction(w, InnerProduct.identity(4)).vector, w.covector)


def test_covariance_direction_is_the_activation_pattern_and_affine_equivariant():
    x, g = _data()
    w = ProbeWeight(torch.randn(4, generator=g, dtype=torch.float64))
    xc = x - x.mean(0)
    sigma = xc.T @ xc / (len(x) - 1)
    v = probe_to_direction(w, InnerProduct.covariance(x)).vector  # the default: no shrinkage
    torch.testing.assert_close(v, sigma @ w.covector)  # Haufe et al.'s pattern Sigma w
    A = torch.randn(4, 4, generator=g, dtype=torch.float64) + 3 * torch.eye(4, dtype=torch.float64)
    w_moved = ProbeWeight(torch.linalg.solve(A.T, w.covector))  # a covector moves by A^-T: same read-out
    torch.testing.assert_close(w_moved.read(x @ A.T), w.read(x))
    v_moved = probe_to_direction(w_moved, InnerProduct.covariance(x @ A.T)).vector
    torch.testing.assert_close(v_moved, A @ v)  # the direction moves by A: equivariant
    v_eucl = probe_to_direction(w_moved, InnerProduct.identity(4)).vector
    assert not torch.allclose(v_eucl, A @ w.covector)  # the Euclidean choice is not


def test_a_singular_covariance_is_refused_unless_shrunk():
    x, _ = _data()
    few = x[:3]  # 3 rows in d = 4: rank 2 after centring
    with pytest.raises(ValueError, match=r"the covariance of x \(3 rows, d = 4\) has rank 2.*shrinkage > 0"):
        InnerProduct.covariance(few)
    assert InnerProduct.covariance(few, shrinkage=0.1).dim == 4


def test_types_cannot_stand_in_for_each_other():
    w = ProbeWeight(torch.ones(3))
    v = Direction(torch.ones(3))
    with pytest.raises(TypeError, match="got a ProbeWeight"):
        Direction(w)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="probe must be a ProbeWeight; got Direction"):
        probe_to_direction(v, InnerProduct.identity(3))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="direction must be a Direction; got ProbeWeight"):
        direction_to_probe(w, InnerProduct.identity(3))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="metric must be an InnerProduct"):
        probe_to_direction(w, torch.eye(3))  # type: ignore[arg-type]
    with pytest.raises((TypeError, RuntimeError, ValueError)):
        torch.as_tensor(w)  # not a tensor: no silent use as a steering vector
    with pytest.raises(ValueError, match="dimension 3 does not match the inner product's 4"):
        probe_to_direction(w, InnerProduct.identity(4))
    with pytest.raises(ValueError, match="positive-definite"):
        InnerProduct.learned(-torch.eye(3))
    with pytest.raises(ValueError, match="symmetric"):
        InnerProduct.learned(torch.tensor([[1.0, 0.5], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="1-D float tensor; got shape \\(2, 2\\)"):
        ProbeWeight(torch.ones(2, 2))


def test_gauge_dependent_quantities_warn_at_qk_sites():
    class FakeSite:
        name, point = "blocks.0.attn_in", "k"

    assert is_qk_site("blocks.3.attn.q") and is_qk_site(FakeSite()) and not is_qk_site("blocks.3.resid_out")
    d = torch.randn(5, 8)
    with pytest.warns(GaugeWarning, match="cosine at the q site"):
        max_pairwise_cosine(d, site="blocks.3.attn.q")
    with pytest.warns(GaugeWarning, match="effective rank at the k site"):
        effective_rank(d, site=FakeSite())
    with pytest.warns(GaugeWarning, match="Euclidean inner product"):
        InnerProduct.identity(8, site="blocks.3.self_attn.k_proj")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        effective_rank(d, site="blocks.3.resid_out")
        max_pairwise_cosine(d)
