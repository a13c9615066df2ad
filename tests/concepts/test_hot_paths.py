"""The fast kernels compute what the plain formulas compute (Matryoshka, VQ, skewness, BatchTopK)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conceptlens.concepts.deleuzian import skewness
from conceptlens.concepts.sae import BatchTopKSAE, MatryoshkaSAE
from conceptlens.concepts.vq import VQCodebook
from conceptlens.concepts.vq_math import ema_update

g = torch.Generator().manual_seed(0)


def rows(n: int, d: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed)).exp()


def test_matryoshka_sparse_prefix_loss_equals_the_dense_one_with_gradients():
    sae = MatryoshkaSAE(width=32, k=4, prefixes=(4, 8, 16, 32), prefix_weights=(1.0, 0.5, 2.0, 1.0),
                        batch_size=64, buffer_size=64, warmup_tokens=64)
    sae.update(rows(64))  # one step: parameters exist
    x = rows(40, seed=1) * sae.scale
    w = sae._weights()
    code = sae._encode(x, w, train=True)
    x_hat = sae._decode(code.z, w, train=True)
    sparse = sae._recon_loss(x, code, x_hat, w)
    dense = sae._dense_prefix_loss(x, code.z, w)
    torch.testing.assert_close(sparse, dense)
    grads = [torch.autograd.grad(loss, [sae.params["W_enc"], sae.params["W_dec"]], retain_graph=True)
             for loss in (sparse, dense)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_vq_step_accumulates_like_the_one_hot_product():
    vq = VQCodebook(n_codes=6, init_size=30, top_k=1, reseed_after=None, seed=0)
    vq.update(rows(30))
    before = vq.fitted.counts.clone(), vq.fitted.sums.clone()
    x = rows(50, seed=2)
    step = vq.train_step(x)
    onehot = F.one_hot(step.code, 6).float()
    counts, sums = ema_update(*before, onehot.sum(0), onehot.T @ x, vq.config.decay)
    torch.testing.assert_close(vq.fitted.counts, counts)
    torch.testing.assert_close(vq.fitted.sums, sums)


def test_skewness_matches_the_textbook_formula():
    x, d = rows(300, 8), torch.randn(5000, 8, generator=g)  # many directions: several chunks
    p = (x - x.mean(0)) @ d.T
    expected = ((p - p.mean(0)) ** 3).mean(0) / p.var(0, unbiased=False) ** 1.5
    torch.testing.assert_close(skewness(x, d), expected, rtol=1e-4, atol=1e-5)


def test_batchtopk_threshold_follows_the_smallest_kept_activation():
    sae = BatchTopKSAE(width=16, k=2, batch_size=32, buffer_size=32, warmup_tokens=32, threshold_momentum=0.5)
    smallest = []
    original = sae._after_step

    def spy(code):
        z = code.z.detach()
        smallest.append(z[z > 0].min())
        original(code)

    sae._after_step = spy
    for seed in range(3):
        sae.update(rows(32, seed=seed))
    expected = smallest[0]
    for value in smallest[1:]:
        expected = expected + 0.5 * (value - expected)
    torch.testing.assert_close(sae.buffer_dict["threshold"], expected)
    assert int(sae.buffer_dict["threshold_steps"]) == 3
