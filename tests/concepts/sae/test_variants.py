"""Each variant's own math against hand-computed references."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.optimize import minimize

from conceptlens.concepts.sae import (BatchTopKSAE, Code, JumpReLUSAE, MatryoshkaSAE, ReLUSAE, SpaDE, TopKSAE,
                                      sparsemax)
from conceptlens.concepts.sae.batchtopk import batch_topk_relu
from conceptlens.concepts.sae.jumprelu import JumpReLUFunction, StepFunction
from conceptlens.concepts.sae.stats import LatentTracker, geometric_median
from conceptlens.concepts.sae.topk import sparse_decode, topk_relu


def data(n: int = 400, d: int = 8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 1 + 2 * torch.randn(n, d, generator=g)


def trained(cls, n=400, **kwargs):
    sae = cls(width=16, batch_size=100, warmup_tokens=100, buffer_size=100, seed=0, **kwargs)
    sae.update(data(n))
    return sae


def test_warmup_scale_makes_mean_squared_norm_d():
    x = data(300)
    sae = TopKSAE(width=16, k=2, batch_size=100, warmup_tokens=250)
    sae.update(x[:200])
    assert sae.scale is None and sae.stats().steps == 0
    sae.update(x[200:])
    assert sae.scale == pytest.approx(math.sqrt(8 / x[:250].double().pow(2).sum(1).mean().item()), rel=1e-12)
    assert ((x[:250] * sae.scale).pow(2).sum(1).mean()).item() == pytest.approx(8, rel=1e-5)


def test_topk_keeps_k_largest():
    pre = torch.tensor([[3.0, -1.0, 2.0, 0.5], [-3.0, -2.0, -1.0, 4.0]])
    expected = torch.tensor([[3.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, 4.0]])  # ReLU after the top-k
    torch.testing.assert_close(topk_relu(pre, 2), expected)
    z = trained(TopKSAE, k=3).encode(data(50, seed=1))
    assert ((z != 0).sum(1) <= 3).all() and (z >= 0).all()


def test_sparse_decode_equals_the_dense_product_and_its_gradients():
    g = torch.Generator().manual_seed(0)
    pre = torch.randn(20, 16, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(16, 5, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randn(20, 5, generator=g, dtype=torch.float64)
    grads = []
    for decode in (lambda z: sparse_decode(z, 3, W), lambda z: z @ W):
        out = decode(topk_relu(pre, 3))
        (out - target).pow(2).sum().backward()
        grads.append((out.detach(), pre.grad.clone(), W.grad.clone()))
        pre.grad, W.grad = None, None
    for sparse, dense in zip(*grads):
        torch.testing.assert_close(sparse, dense)
    sae = trained(TopKSAE, k=2)
    z = torch.zeros(1, 16)
    z[0, :5] = 1.0  # more than k latents, as a clamp could make: decode() takes the dense product
    torch.testing.assert_close(sae.decode(z), z @ sae.concept_set().directions + sae.concept_set().encoder["b_dec"])


def test_batch_topk_keeps_k_times_batch_over_the_whole_batch():
    pre = torch.tensor([[5.0, 4.0, 3.0], [0.1, -1.0, 0.2]])
    torch.testing.assert_close(batch_topk_relu(pre, 1), torch.tensor([[5.0, 4.0, 0.0], [0.0, 0.0, 0.0]]))
    pre = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
    z = batch_topk_relu(pre, 3)
    kept = pre.relu().flatten().sort(descending=True).values[: 3 * 32]
    torch.testing.assert_close(z.flatten().sort(descending=True).values[: 3 * 32], kept)
    assert (z != 0).sum() == 3 * 32


def test_batch_topk_threshold_is_a_moving_average_of_the_smallest_kept():
    sae = trained(BatchTopKSAE, k=2, threshold_momentum=0.25)
    sae.buffer_dict = {"threshold": torch.zeros(()), "threshold_steps": torch.zeros((), dtype=torch.int64)}
    z1, z2 = torch.tensor([[0.0, 2.0, 0.5]]), torch.tensor([[1.5, 0.0, 3.0]])
    sae._after_step(Code(z1, z1))
    assert sae.buffer_dict["threshold"].item() == 0.5  # the first estimate is taken as is
    sae._after_step(Code(z2, z2))
    assert sae.buffer_dict["threshold"].item() == pytest.approx(0.75 * 0.5 + 0.25 * 1.5)
    sae.buffer_dict["threshold"].fill_(0.7)
    pre = torch.tensor([[0.5, 0.7, 0.9, -1.0]])
    torch.testing.assert_close(sae._activate(pre, sae._weights(), train=False), torch.tensor([[0.0, 0.0, 0.9, 0.0]]))


def test_jumprelu_straight_through_gradients():
    pre = torch.tensor([[0.10, 0.5004, 0.4998, 2.0]], requires_grad=True)
    theta = torch.tensor([0.5, 0.5, 0.5, 0.5], requires_grad=True)
    eps = 1e-3
    out = JumpReLUFunction.apply(pre, theta, eps)
    torch.testing.assert_close(out.detach(), torch.tensor([[0.0, 0.5004, 0.0, 2.0]]))
    out.sum().backward()
    torch.testing.assert_close(pre.grad, torch.tensor([[0.0, 1.0, 0.0, 1.0]]))
    # -(theta / eps) * K((pre - theta) / eps): the kernel is 1 for the two entries within eps/2
    torch.testing.assert_close(theta.grad, torch.tensor([0.0, -500.0, -500.0, 0.0]))
    pre.grad, theta.grad = None, None
    step = StepFunction.apply(pre, theta, eps)
    torch.testing.assert_close(step.detach(), torch.tensor([[0.0, 1.0, 0.0, 1.0]]))
    step.sum().backward()
    assert pre.grad is None or not pre.grad.any()
    torch.testing.assert_close(theta.grad, torch.tensor([0.0, -1000.0, -1000.0, 0.0]))


def test_jumprelu_threshold_is_exp_log_threshold_and_l0_penalty():
    sae = trained(JumpReLUSAE, l0=0.3, threshold_init=0.2)
    w = sae._weights()
    torch.testing.assert_close(w["threshold"], sae.params["log_threshold"].exp())
    x = data(20, seed=2) * sae.scale
    code = sae._encode(x, w, train=True)
    expected = 0.3 * (code.pre > w["threshold"]).float().sum(1).mean()
    torch.testing.assert_close(sae._penalty(x, sae._decode(code.z, w), code, w), expected)


def test_relu_penalty_weights_latents_by_decoder_norms():
    sae = trained(ReLUSAE, l1=2.0)
    unit = torch.nn.functional.normalize(sae.params["W_dec"].detach(), dim=1)  # rows of norm 1, 2, ..., 16
    w = {**sae._weights(), "W_dec": unit * torch.arange(1, 17.0)[:, None]}
    x = data(20, seed=2) * sae.scale
    code = sae._encode(x, w, train=True)
    expected = 2.0 * sae.buffer_dict["l1_unit"] * (code.z * torch.arange(1, 17.0)).sum(1).mean()
    torch.testing.assert_close(sae._penalty(x, sae._decode(code.z, w), code, w), expected)


def test_relu_l1_unit_is_the_first_batch_spread_and_its_warm_up_is_linear():
    x = data(400)
    sae = ReLUSAE(width=16, batch_size=100, warmup_tokens=100, buffer_size=100, l1=2.0, l1_warmup_tokens=250,
                  b_dec_init="zeros", seed=0)
    sae.update(x[:100])  # warm-up only: no step yet
    sae.flush()  # one step on the 100 buffered rows
    first = x[:100] * sae.scale
    spread = ((first - first.mean(0)).pow(2).sum(1).mean() / 8).sqrt()
    torch.testing.assert_close(sae.buffer_dict["l1_unit"], spread)
    assert sae.l1_now() == pytest.approx(2.0 * 100 / 250)
    sae.update(x[100:300])
    assert sae.l1_now() == 2.0  # 300 trained tokens: past the ramp
    assert ReLUSAE(width=8, l1=2.0).l1_now() == 2.0  # no ramp by default


def test_auxk_trains_only_dead_latents():
    sae = trained(TopKSAE, k=2, dead_after=10**9)
    x = data(50, seed=3) * sae.scale
    w = sae._weights()
    code = sae._encode(x, w, train=True)
    assert sae._penalty(x, sae._decode(code.z, w), code, w).item() == 0  # nobody is dead yet
    dead = torch.zeros(16, dtype=torch.bool)
    dead[[1, 4, 9]] = True
    sae.trainer.tracker.since_fired[dead] = 10**9
    sae.trainer.tracker.refresh()  # the host-side bound follows a direct edit of the counters
    code = sae._encode(x, w, train=True)
    penalty = sae._penalty(x, sae._decode(code.z, w).detach(), code, w)
    assert penalty.item() > 0
    (grad,) = torch.autograd.grad(penalty, sae.params["W_enc"])
    assert grad[:, dead].abs().sum() > 0 and not grad[:, ~dead].any()


def test_matryoshka_loss_sums_prefix_reconstructions():
    sae = trained(MatryoshkaSAE, k=4, prefixes=(2, 8, 16), prefix_weights=(1.0, 0.5, 2.0))
    x = data(30, seed=4) * sae.scale
    w = sae._weights()
    code = sae._encode(x, w, train=True)
    z = code.z
    expected = sum(weight * (x - (z[:, :m] @ w["W_dec"][:m] + w["b_dec"])).pow(2).sum(1).mean()
                   for m, weight in ((2, 1.0), (8, 0.5), (16, 2.0)))
    torch.testing.assert_close(sae._recon_loss(x, code, sae._decode(z, w), w), expected)


def test_spade_codes_and_raw_space_fold():
    x = data(100)
    sae = SpaDE(width=16, batch_size=100, warmup_tokens=100, seed=0)
    sae.d = 8
    init = sae._init_params(x)
    # lambda starts at 1 / the median squared distance from a token to its nearest other prototype
    rows = [min(range(100), key=lambda i: (x[i] - p).abs().sum().item()) for p in init["prototypes"]]
    d2 = torch.cdist(x, init["prototypes"]).pow(2)
    d2[torch.tensor(rows)[None, :] == torch.arange(100)[:, None]] = float("inf")
    assert F.softplus(init["lambda_pre"]).item() == pytest.approx(1 / d2.min(1).values.median().item(), rel=1e-4)
    sae = trained(SpaDE, gamma=0.3)
    enc = sae.concept_set().encoder
    x = data(40, seed=5)
    # raw space: distances in units of each feature's warm-up standard deviation
    std = enc["input_std"]
    expected = sparsemax(-enc["lambda"] * torch.cdist(x / std, enc["prototypes"] / std).pow(2))
    torch.testing.assert_close(sae.encode(x), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sae.decode(expected), expected @ sae.concept_set().directions + enc["input_mean"],
                               rtol=1e-4, atol=1e-4)
    xs = (x - enc["input_mean"]) / std
    w = sae._weights()
    code = sae._encode(xs, w, train=True)
    distances = torch.cdist(xs, w["prototypes"]).pow(2)
    torch.testing.assert_close(sae._penalty(xs, None, code, w), 0.3 * (code.z * distances).sum(1).mean(),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("standardise", ["isotropic", "features"])
def test_spade_standardises_inputs_over_the_warm_up(standardise):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 6, generator=g) * torch.tensor([0.1, 1, 10, 100, 1, 1]) + torch.arange(6.0) * 7
    x[:, 5] = 3.0  # a constant feature
    sae = SpaDE(width=8, batch_size=50, warmup_tokens=120, standardise=standardise, seed=0)
    sae.update(x[:70])
    sae.update(x[70:])  # the warm-up ends inside this chunk: rows 120+ are not part of it
    warm = x[:120].double()
    var = warm.var(0, unbiased=False)
    if standardise == "features":
        std = var.sqrt()
        std[5] = 1.0  # a constant feature keeps sigma = 1
    else:  # one sigma: E||x_n||^2 = d after centring
        std = var.mean().sqrt().expand(6)
    torch.testing.assert_close(sae.buffer_dict["input_mean"], warm.mean(0).float())
    torch.testing.assert_close(sae.buffer_dict["input_std"], std.float())
    raw = sae.concept_set().encoder
    torch.testing.assert_close(raw["input_std"], std.float())
    torch.testing.assert_close(raw["prototypes"], sae.params["prototypes"].detach() * std.float() + warm.mean(0).float())


def test_spade_replicas_warming_up_pool_their_feature_sums():
    x = data(160)
    one = SpaDE(width=8, batch_size=50, warmup_tokens=100, standardise="features", seed=0)
    one.update(x[:60])
    one.update(x[60:100])
    a = SpaDE(width=8, batch_size=50, warmup_tokens=100, standardise="features", seed=0)
    b = SpaDE(width=8, batch_size=50, warmup_tokens=100, standardise="features", seed=0)
    a.update(x[:60])
    b.update(x[60:100])
    a.merge(b.state_dict())
    for key in ("input_mean", "input_std"):
        torch.testing.assert_close(a.buffer_dict[key], one.buffer_dict[key])


def test_geometric_median_minimises_summed_distances():
    x = torch.randn(60, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[:5] += 50  # outliers barely move it
    reference = minimize(lambda m: np.linalg.norm(x.numpy() - m, axis=1).sum(), x.mean(0).numpy(),
                         method="Nelder-Mead", options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 20000}).x
    np.testing.assert_allclose(geometric_median(x, iters=200).numpy(), reference, atol=1e-5)


def test_latent_tracker_marks_latents_dead_after_silence():
    tracker = LatentTracker(width=3, dead_after=100)
    tracker.observe(torch.tensor([5, 0, 1]), 60)
    assert not tracker.dead().any()
    tracker.observe(torch.tensor([0, 0, 2]), 50)
    assert tracker.dead().tolist() == [False, True, False]  # silent for 50, 110 and 0 tokens
    tracker.observe(torch.tensor([0, 0, 1]), 50)
    assert tracker.dead().tolist() == [True, True, False]  # 100, 160, 0
    torch.testing.assert_close(tracker.frequency(), torch.tensor([5, 0, 4]) / 160)


@pytest.mark.parametrize("make, match", [
    (lambda: TopKSAE(width=8, k=9), "k must be at most width=8"),
    (lambda: TopKSAE(width=8, k=0), "k must be a positive integer"),
    (lambda: TopKSAE(width=0, k=1), "width must be a positive integer"),
    (lambda: TopKSAE(width=8.0, k=1), "width must be a positive integer; got 8.0"),
    (lambda: ReLUSAE(width=8, lr=-1.0), "lr must be"),
    (lambda: ReLUSAE(width=8, l1=-0.1), "l1 must be"),
    (lambda: ReLUSAE(width=8, l1_warmup_tokens=-1), "l1_warmup_tokens"),
    (lambda: ReLUSAE(width=8, betas=(0.9, 1.0)), "betas"),
    (lambda: ReLUSAE(width=8, batch_size=0), "batch_size"),
    (lambda: ReLUSAE(width=8, b_dec_init="median"), "b_dec_init must be one of"),
    (lambda: JumpReLUSAE(width=8, bandwidth=0.0), "bandwidth"),
    (lambda: BatchTopKSAE(width=8, k=2, threshold_momentum=1.5), "threshold_momentum"),
    (lambda: MatryoshkaSAE(width=8, k=2, prefixes=(4, 2, 8)), "strictly increasing"),
    (lambda: MatryoshkaSAE(width=8, k=2, prefixes=(2, 4)), "ending at width=8"),
    (lambda: MatryoshkaSAE(width=8, k=2, prefixes=(4, 8), prefix_weights=(1.0,)), "2 numbers"),
    (lambda: SpaDE(width=8, gamma=float("nan")), "gamma"),
    (lambda: SpaDE(width=8, standardise="pca"), "standardise"),
])
def test_bad_configs_raise_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_arguments_raise_type_error():
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['kk'\]; valid: \['width'"):
        TopKSAE(width=8, kk=2)
    with pytest.raises(TypeError, match=r"missing required argument\(s\) \['k'\]"):
        TopKSAE(width=8)
    with pytest.raises(TypeError, match="not both"):
        TopKSAE(TopKSAE.Config(width=8, k=2), k=3)
    assert TopKSAE(TopKSAE.Config(width=8, k=2)).config.k == 2
    assert MatryoshkaSAE(width=64, k=2).config.prefixes == (8, 16, 32, 64)


def test_relu_decoder_norms_stay_free_through_training_and_export():
    sae = trained(ReLUSAE, l1=2.0)
    norms = sae.params["W_dec"].detach().norm(dim=1)
    assert not torch.allclose(norms, torch.ones_like(norms), atol=0.05)  # not renormalised during training
    x = data(20, seed=2)
    cs = sae.concept_set()
    torch.testing.assert_close(cs.directions, sae.params["W_dec"].detach())  # rows as trained
    with torch.no_grad():
        z_train = sae._encode(x * sae.scale, sae._weights(), train=False).z / sae.scale
    torch.testing.assert_close(sae.encode(x), z_train, rtol=1e-4, atol=1e-5)
    assert ReLUSAE(width=8).config.decoder_init_norm == 0.1


def test_spade_prototypes_start_at_distinct_rows():
    sae = SpaDE(width=16, batch_size=16, warmup_tokens=16)
    x = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3) + 1  # 16 distinct rows
    sae.update(x)
    sae.flush()  # the first (and only) step initialises the prototypes
    protos = sae.params["prototypes"].detach() / sae.scale
    assert len({tuple(r) for r in protos.round(decimals=3).tolist()}) == 16  # every row once: no repeats
    wide = SpaDE(width=40, batch_size=16, warmup_tokens=16)
    wide.update(x)
    wide.flush()
    rows = {tuple(r) for r in (wide.params["prototypes"].detach() / wide.scale).round(decimals=3).tolist()}
    assert len(rows) == 16  # a batch smaller than the width is reused whole


def test_geometric_median_stops_when_it_repeats_itself_with_the_same_bits(monkeypatch):
    from conceptlens.concepts.sae import stats

    x = torch.randn(500, 16, generator=torch.Generator().manual_seed(0)) * 3 + 1
    plain = [x.mean(0)]  # every step taken
    for _ in range(40):
        plain.append(stats.weiszfeld_step(x, plain[-1]))
    calls = []
    step = stats.weiszfeld_step
    monkeypatch.setattr(stats, "weiszfeld_step", lambda *a: calls.append(1) or step(*a))
    for iters in (1, 2, 7, 29, 30, 31, 40):
        assert torch.equal(geometric_median(x, iters=iters), plain[iters])
    calls.clear()
    geometric_median(x, iters=40)
    assert len(calls) < 40  # it settled on a point or a cycle and stopped stepping


@pytest.mark.parametrize("rows", [torch.full((1, 6), 2.0), torch.tensor([[1.0, -2.0, 0.5, 3.0, 0.0, 1.0]]).repeat(4, 1)])
def test_jumprelu_starts_on_a_first_batch_whose_rows_do_not_vary(rows):
    """One row, or copies of one: no spread to set the thresholds by (log 0 raised 'math domain error');
    they start at threshold_init in units of the normalised rows' scale, and the bandwidth with them."""
    sae = JumpReLUSAE(width=8, batch_size=4, warmup_tokens=1, seed=0)
    sae.update(rows)
    sae.flush()
    assert sae.stats().steps >= 1 and float(sae.buffer_dict["spread"]) == 1.0
    assert torch.allclose(sae.params["log_threshold"].exp(), torch.full((8,), sae.config.threshold_init), rtol=1e-2)
