"""The sparse encoder backward of TopK-gated SAEs against the dense product it replaces."""

import pytest
import torch

from conceptlens.concepts.sae import BatchTopKSAE, JumpReLUSAE, MatryoshkaSAE, TopKSAE
from conceptlens.concepts.sae import active, batchtopk, jumprelu, topk
from conceptlens.concepts.sae.active import Active, active_decode, active_pre, prefix_losses, row_major
from conceptlens.concepts.sae.base import Code
from conceptlens.concepts.sae.nested import ActMSAE


def test_active_pre_gradients_equal_the_dense_products():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 6, generator=g, dtype=torch.float64)
    w = {"b_dec": torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True),
         "W_enc": torch.randn(6, 20, generator=g, dtype=torch.float64, requires_grad=True),
         "b_enc": torch.randn(20, generator=g, dtype=torch.float64, requires_grad=True)}
    target = torch.randn(30, 4, generator=g, dtype=torch.float64)
    got = []
    for graph in (False, True):
        with torch.set_grad_enabled(graph):
            pre = (x - w["b_dec"]) @ w["W_enc"] + w["b_enc"]  # (30, 20)
        indices = pre.detach().topk(4, dim=-1).indices
        values = active_pre(pre, *row_major(indices), x, w).view(30, 4)
        ((values - target) ** 3).sum().backward()
        got.append([values.detach()] + [w[name].grad.clone() for name in ("b_dec", "W_enc", "b_enc")])
        for v in w.values():
            v.grad = None
    assert got[0][0].shape == (30, 4)
    for sparse, dense in zip(*got):
        torch.testing.assert_close(sparse, dense)


def test_active_decode_equals_embedding_bag_value_and_gradients():
    # small integers: every product and sum is exact in float32, so "equal" does not hang on summation order
    g = torch.Generator().manual_seed(0)
    latents = torch.tensor([3, 0, 7, 7, 1, 2, 9, 0, 4])  # row 1 names latent 7 twice; row 3 is empty
    offsets = torch.tensor([0, 2, 5, 5])  # rows of 2, 3, 0 and 4 entries
    values0 = torch.randint(-3, 4, (9,), generator=g).float()
    W0 = torch.randint(-4, 5, (10, 5), generator=g).float()
    grad = torch.randint(-2, 3, (4, 5), generator=g).float()
    got = []
    for decode in (active_decode, lambda lat, val, off, W: torch.nn.functional.embedding_bag(
            lat, W, off, mode="sum", per_sample_weights=val)):
        values, W = values0.clone().requires_grad_(), W0.clone().requires_grad_()
        out = decode(latents, values, offsets, W)
        out.backward(grad)
        got.append((out.detach(), values.grad, W.grad))
    for ours, reference in zip(*got):
        assert torch.equal(ours, reference)
    assert got[0][2][7].abs().sum() > 0 and not got[0][2][5].any()  # a latent used twice; one never used
    with torch.no_grad():
        assert torch.equal(active_decode(latents, values0, offsets, W0), got[1][0])


@pytest.mark.parametrize("cls", [TopKSAE, MatryoshkaSAE, ActMSAE, BatchTopKSAE])
@pytest.mark.parametrize("dead_after", [10_000_000, 1])  # 1: most latents dead, the AuxK term on
def test_training_step_equals_the_dense_step(cls, dead_after, monkeypatch):
    x = 1 + 2 * torch.randn(300, 8, generator=torch.Generator().manual_seed(0))
    kwargs = dict(width=32, k=3, batch_size=100, warmup_tokens=100, buffer_size=100, dead_after=dead_after)
    if cls is MatryoshkaSAE:
        kwargs["prefixes"] = (4, 12, 32)
    results = []
    for sparse in (True, False):
        monkeypatch.setattr(topk, "sparse_backward", lambda rows: sparse)
        sae = cls(seed=0, **kwargs)
        sae.update(x[:200])  # parameters and a firing record
        if dead_after == 1:
            sae.trainer.tracker.since_fired[::2] = 10**6  # half the latents dead
        batch = sae._normalise(x[200:])
        w = sae._compute_weights()
        target, code, x_hat = sae._forward(batch, w)
        assert (code.active is not None) == sparse and code.pre.requires_grad != sparse
        loss = sae._recon_loss(target, code, x_hat, w) + sae._penalty(target, x_hat, code, w)
        loss.backward()
        aux = sae._penalty(target, x_hat, code, w).detach()
        results.append([loss.detach(), aux, x_hat.detach()] + [p.grad.clone() for p in sae.params.values()])
    assert (results[0][1] > 0) == (dead_after == 1)
    for sparse, dense in zip(*results):
        torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [TopKSAE, BatchTopKSAE])
def test_counts_and_threshold_from_the_active_latents_equal_the_dense_ones(cls):
    x = 1 + 2 * torch.randn(400, 8, generator=torch.Generator().manual_seed(1))
    fired = []
    for sparse in (True, False):
        sae = cls(width=32, k=3, batch_size=100, warmup_tokens=100, buffer_size=100, seed=0)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(topk, "sparse_backward", lambda rows: sparse)
            sae.update(x)
        fired.append((sae.trainer.tracker.fired.clone(), sae.stats(), sae.buffer_dict.get("threshold", torch.zeros(()))))
    assert torch.equal(fired[0][0], fired[1][0]) and fired[0][1].last.l0 == fired[1][1].last.l0
    assert fired[0][1].last.fvu == pytest.approx(fired[1][1].last.fvu, rel=1e-4)
    assert float(fired[0][2]) == pytest.approx(float(fired[1][2]), rel=1e-5)  # BatchTopK's inference threshold
    assert (float(fired[0][2]) > 0) == (cls is BatchTopKSAE)


def test_jumprelu_training_step_equals_the_dense_step(monkeypatch):
    """The sparse step reads only the active entries and those within half a bandwidth of their
    threshold: the loss, the reconstruction and every gradient (the thresholds' straight-through
    ones from the reconstruction and from the L0 penalty included) are the dense step's."""
    x = 1 + 2 * torch.randn(300, 8, generator=torch.Generator().manual_seed(0))
    results = []
    for sparse in (True, False):
        monkeypatch.setattr(jumprelu, "sparse_backward", lambda rows: sparse)
        sae = JumpReLUSAE(width=32, batch_size=100, warmup_tokens=100, buffer_size=100, bandwidth=0.5, seed=0)
        sae.update(x[:200])
        batch = sae._normalise(x[200:])
        w = sae._compute_weights()
        target, code, x_hat = sae._forward(batch, w)
        assert (code.active is not None) == sparse
        if sparse:  # the code holds every active entry, and entries below the threshold with value 0
            dense = JumpReLUSAE._encode(sae, batch, w, train=False).z.detach()
            torch.testing.assert_close(code.z.detach(), dense, rtol=1e-5, atol=1e-6)
            assert len(code.active.values) > int(dense.ne(0).sum()) > 0
        loss = sae._recon_loss(target, code, x_hat, w) + sae._penalty(target, x_hat, code, w)
        loss.backward()
        results.append([loss.detach(), x_hat.detach()] + [p.grad.clone() for p in sae.params.values()])
    assert results[1][-1].ne(0).sum() > 4  # several thresholds have a gradient
    for sparse, dense in zip(*results):
        torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-6)


def test_jumprelu_fit_equals_the_dense_fit(monkeypatch):
    x = 1 + 2 * torch.randn(1000, 8, generator=torch.Generator().manual_seed(2))
    fits = []
    for sparse in (True, False):
        monkeypatch.setattr(jumprelu, "sparse_backward", lambda rows: sparse)
        sae = JumpReLUSAE(width=32, batch_size=100, warmup_tokens=100, buffer_size=100, seed=0)
        sae.update(x)
        fits.append(sae)
    fired = [fit.trainer.tracker.fired.double() for fit in fits]
    assert fired[0].sum() > 0
    torch.testing.assert_close(fired[0], fired[1], rtol=0.02, atol=2)  # an entry at a threshold may fire in one only
    for name, value in fits[0].params.items():
        torch.testing.assert_close(value, fits[1].params[name], rtol=1e-4, atol=1e-5)


def test_sparse_backward_only_on_cpu():
    assert active.sparse_backward(torch.zeros(1)) and not active.sparse_backward(torch.zeros(1, device="meta"))


def test_a_sparse_code_builds_its_dense_latents_only_when_read():
    g = torch.Generator().manual_seed(2)
    pre = torch.randn(5, 12, generator=g)
    rows, latents = torch.tensor([0, 0, 2, 3, 3, 3, 4]), torch.tensor([1, 7, 0, 2, 5, 11, 3])  # row 1 keeps none
    values = torch.rand(7, generator=g, requires_grad=True)
    code = Code(None, pre, Active(values, latents, torch.tensor([0, 2, 2, 3, 6])))
    expected = torch.zeros(5, 12)
    expected[rows, latents] = values.detach()
    assert torch.equal(code.z, expected) and code.z is code.z  # built once
    (grad,) = torch.autograd.grad((code.z * torch.arange(60.0).view(5, 12)).sum(), values)
    assert torch.equal(grad, (rows * 12 + latents).float())
    with pytest.raises(ValueError, match="needs its latents"):
        Code(None, pre)


@pytest.mark.parametrize("cls", [TopKSAE, MatryoshkaSAE, ActMSAE, BatchTopKSAE])
def test_sparse_training_never_builds_the_dense_code_and_trains_as_if_it_did(cls, monkeypatch):
    x = 1 + 2 * torch.randn(600, 8, generator=torch.Generator().manual_seed(3))
    kwargs = dict(width=64, k=2, batch_size=100, warmup_tokens=100, buffer_size=100, dead_after=1, seed=0)
    if cls is MatryoshkaSAE:
        kwargs["prefixes"] = (4, 12, 64)
    eager = cls(**kwargs)  # the reference: the dense code built at every step, Matryoshka's
    encode, recon = eager._encode, eager._recon_loss  # prefixes from a top-k over it

    def dense_encode(rows, w, train):
        code = encode(rows, w, train)
        return Code(code.z, code.pre, code.active)

    eager._encode = dense_encode
    eager._recon_loss = lambda x, code, x_hat, w: recon(x, Code(code.z, code.pre), x_hat, w)
    lazy = cls(**kwargs)
    eager.update(x)
    with monkeypatch.context() as m:
        m.setattr(Active, "dense", lambda *a: pytest.fail("the training step built the dense code"))
        lazy.update(x)
    assert lazy.stats().steps == 6 and lazy.stats().mean.dead_fraction > 0  # AuxK on
    # the same operations but for Matryoshka's prefix gathers, whose order may differ
    tol = dict(rtol=1e-5, atol=1e-7) if cls is MatryoshkaSAE else dict(rtol=0, atol=0)
    for name, p in eager.params.items():
        torch.testing.assert_close(lazy.params[name], p, **tol)
    torch.testing.assert_close(lazy.stats().last.fvu, eager.stats().last.fvu, **tol)


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


def _batch_topk_reference(pre, budget):
    return pre.relu().flatten().topk(budget, sorted=False).indices.sort().values


@pytest.mark.parametrize("shift", [0.0, -2.0, 3.0])  # mostly negative, centred, mostly positive
@pytest.mark.parametrize("shape", [(64, 200), (7, 1000), (300, 61)])
def test_batch_topk_from_a_sampled_threshold_picks_the_whole_batch_top_k(shape, shift):
    g = torch.Generator().manual_seed(shape[0])
    pre = torch.randn(*shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 3 + shift  # rich and plain rows
    budget = 4 * shape[0]
    got = batchtopk.batch_topk_candidates(pre, budget)
    assert got is not None and torch.equal(got, _batch_topk_reference(pre, budget))
    sae = BatchTopKSAE(width=shape[1], k=4)
    rows, latents = sae._select(pre)
    assert torch.equal(rows * shape[1] + latents, _batch_topk_reference(pre, budget))


def test_batch_topk_from_a_sampled_threshold_declines_ties_and_too_few_positives():
    pre = -torch.rand(10, 50, generator=torch.Generator().manual_seed(0))
    pre.view(-1)[::37] = 5.0  # 14 equal entries: a budget of 8 cuts through the tie
    assert batchtopk.batch_topk_candidates(pre, 8) is None
    assert batchtopk.batch_topk_candidates(pre, 20) is None  # only 14 positive entries
    rows, latents = BatchTopKSAE(width=50, k=2)._select(pre[:4])  # declined: the whole batch's top-k
    assert torch.equal(rows * 50 + latents, _batch_topk_reference(pre[:4], 8))


def test_each_prefix_gathers_only_its_own_active_latents(monkeypatch):
    g = torch.Generator().manual_seed(4)
    b, width, d, k = 40, 32, 6, 4
    top = torch.randn(b, width, generator=g).topk(k, dim=1, sorted=False)
    latents = top.indices.flatten()
    latents[:k] = torch.tensor([0, 1, 2, 3])  # row 0 is all in the first prefix,
    latents[k:2 * k] = torch.tensor([28, 29, 30, 31])  # row 1 outside every prefix but the last
    values = top.values.relu().flatten().requires_grad_(True)
    z = torch.zeros(b, width).index_put((torch.arange(b).repeat_interleave(k), latents), values)
    W_dec = torch.randn(width, d, generator=g, requires_grad=True)
    b_dec, x = torch.randn(d, generator=g), torch.randn(b, d, generator=g)
    prefixes, weights = (4, 8, 32), (1.0, 2.0, 1.0)
    gathered = []
    bag = active.F.embedding_bag
    monkeypatch.setattr(active.F, "embedding_bag",
                        lambda idx, *a, **kw: gathered.append(len(idx)) or bag(idx, *a, **kw))
    got = prefix_losses(x, z @ W_dec + b_dec, Active(values, latents, torch.arange(0, b * k, k)), W_dec, b_dec,
                        prefixes, weights)
    assert gathered == [int((latents < 4).sum()), int((latents < 8).sum())]
    dense = sum(wt * (x - (z[:, :m] @ W_dec[:m] + b_dec)).pow(2).sum(-1).mean() for m, wt in zip(prefixes, weights))
    torch.testing.assert_close(got, dense)
    grads = torch.autograd.grad(got, (values, W_dec), retain_graph=True)  # x_hat shares z's graph
    for mine, reference in zip(grads, torch.autograd.grad(dense, (values, W_dec))):
        torch.testing.assert_close(mine, reference)
