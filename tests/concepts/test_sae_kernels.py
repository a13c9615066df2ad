"""SAE step kernels against the dense computations they replace."""

import torch

from conceptlens.concepts.sae.active import Active, row_major
from conceptlens.concepts.sae_kernels import prefix_losses


def test_prefix_losses_from_active_latents_equal_the_dense_prefix_decodes():
    g = torch.Generator().manual_seed(0)
    b, width, d, k = 6, 16, 5, 3
    pre = torch.randn(b, width, generator=g)
    top = pre.topk(k, dim=1)
    rows, latents = row_major(top.indices)
    values = top.values.relu().flatten().requires_grad_(True)
    z = torch.zeros(b, width).index_put((rows, latents), values)  # the dense code, differentiable in values
    W_dec, b_dec = torch.randn(width, d, generator=g), torch.randn(d, generator=g)
    x = torch.randn(b, d, generator=g)
    prefixes, weights = (2, 4, 8, 16), (1.0, 0.5, 2.0, 1.0)
    dense = sum(wt * (x - (z[:, :m] @ W_dec[:m] + b_dec)).pow(2).sum(-1).mean() for m, wt in zip(prefixes, weights))
    offsets = torch.arange(0, b * k, k)
    got = prefix_losses(x, z @ W_dec + b_dec, Active(values, latents, offsets), W_dec, b_dec, prefixes, weights)
    torch.testing.assert_close(got, dense)
    (grad_dense,) = torch.autograd.grad(dense, values, retain_graph=True)  # x_hat shares z's graph
    (grad_got,) = torch.autograd.grad(got, values)
    torch.testing.assert_close(grad_got, grad_dense)
