"""sparsemax against the Euclidean projection onto the simplex computed by scipy."""

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from conceptlens.concepts.sae.sparsemax import sparsemax


def simplex_projection(z: np.ndarray) -> np.ndarray:
    """argmin_{p >= 0, sum p = 1} ||p - z||^2 by SLSQP."""
    n = z.shape[0]
    result = minimize(lambda p: ((p - z) ** 2).sum(), np.full(n, 1 / n), jac=lambda p: 2 * (p - z),
                      bounds=[(0, None)] * n, constraints=[{"type": "eq", "fun": lambda p: p.sum() - 1}],
                      method="SLSQP", options={"ftol": 1e-12, "maxiter": 500})
    # (SLSQP may stop with 'positive directional derivative' once at machine precision;
    # the comparison below is the check)
    return result.x


def test_matches_scipy_projection():
    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([0.1, 1.0, 3.0], dtype=torch.float64)[torch.arange(21) % 3, None]  # dense to sparse
    z = torch.randn(21, 7, generator=g, dtype=torch.float64) * scales
    p = sparsemax(z)
    for row, expected in zip(z.numpy(), p.numpy()):
        np.testing.assert_allclose(expected, simplex_projection(row), atol=1e-6)


def test_outputs_lie_on_the_simplex_with_exact_zeros():
    z = torch.randn(100, 30, generator=torch.Generator().manual_seed(1)) * 3
    p = sparsemax(z)
    assert (p >= 0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(100))
    assert (p == 0).any(-1).all()  # scores spread this widely always leave some out


def test_is_the_identity_on_the_simplex_and_shift_invariant():
    p = torch.tensor([[0.2, 0.0, 0.5, 0.3]], dtype=torch.float64)
    torch.testing.assert_close(sparsemax(p), p)
    z = torch.randn(5, 6, dtype=torch.float64)
    torch.testing.assert_close(sparsemax(z + 4.2), sparsemax(z))


def test_dim_argument():
    z = torch.randn(4, 5, 6, dtype=torch.float64)
    torch.testing.assert_close(sparsemax(z, dim=1), sparsemax(z.transpose(1, 2), dim=-1).transpose(1, 2))


def test_gradcheck():
    z = (torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 2).requires_grad_()
    assert torch.autograd.gradcheck(sparsemax, (z,))
    assert torch.autograd.gradcheck(lambda t: sparsemax(t, dim=0), (z,))


def test_rejects_integer_input():
    with pytest.raises(TypeError, match="floating-point"):
        sparsemax(torch.tensor([1, 2, 3]))
