"""VQCodebook against hand-computed EMA steps, softmax sampling, k-means references and
bit-identical resumes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.concepts.vq import (
    VQCodebook, fvu_from_sums, fvu_sums, laplace_smooth, perplexity, sample_top_k,
)

from tests.conftest import assert_same_state


def mixture(n_clusters: int, d: int, *, scale: float = 5.0, noise: float = 0.3, seed: int = 0):
    """A sampler of a Gaussian mixture with equal weights: n -> ((n, d), labels (n,))."""
    gen = torch.Generator().manual_seed(seed)
    centres = scale * torch.randn(n_clusters, d, generator=gen)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(n_clusters, (n,), generator=gen)
        return centres[labels] + noise * torch.randn(n, d, generator=gen), labels
    return draw


def test_laplace_smoothing_matches_the_formula_by_hand():
    # N = 4, K = 3, eps = 0.5: n_i = (N_i + 0.5) / (4 + 1.5) * 4
    got = laplace_smooth(torch.tensor([3.0, 0.0, 1.0]), 0.5)
    torch.testing.assert_close(got, torch.tensor([3.5 * 4 / 5.5, 0.5 * 4 / 5.5, 1.5 * 4 / 5.5]))
    assert got.sum().item() == pytest.approx(4.0)


def test_ema_step_matches_a_hand_computed_update():
    vq = VQCodebook(2, decay=0.5, eps=0.5, top_k=1, init="random", init_size=2, batch_size=4,
                    buffer_size=4, reseed_after=None)
    vq.update(torch.tensor([[0.0, 0.0], [10.0, 0.0]]))
    low = int(vq.codes[:, 0].argmin())              # the code initialised at (0, 0)
    order = [low, 1 - low]
    torch.testing.assert_close(vq.codes[order], torch.tensor([[0.0, 0.0], [10.0, 0.0]]))
    # init: one token per code, scaled to batch_size=4 tokens per step -> counts (2, 2)
    torch.testing.assert_close(vq.counts, torch.tensor([2.0, 2.0]))
    vq.update(torch.tensor([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0], [12.0, 0.0]]))
    # batch counts (3, 1), sums (6, 0), (12, 0); counts 0.5*2 + 0.5*(3, 1) = (2.5, 1.5)
    # sums 0.5*(0, 20) + 0.5*(6, 12) = (3, 16); smoothed counts (3/5*4, 2/5*4) = (2.4, 1.6)
    torch.testing.assert_close(vq.counts[order], torch.tensor([2.5, 1.5]))
    torch.testing.assert_close(vq.codes[order], torch.tensor([[1.25, 0.0], [10.0, 0.0]]))


def test_top_k_sampling_stays_among_the_k_nearest_and_follows_the_softmax():
    gen = torch.Generator().manual_seed(1)
    dist = torch.rand(4000, 20, generator=gen)
    picked = sample_top_k(dist, 5, 10.0, gen)
    top5 = dist.topk(5, dim=1, largest=False).indices
    assert (top5 == picked[:, None]).any(1).all()
    rank = (top5 == picked[:, None]).float().argmax(1)
    assert set(rank.tolist()) == {0, 1, 2, 3, 4}      # a high temperature explores all five

    row = torch.arange(10.0) * 0.5                     # distances 0, 0.5, ..., 4.5
    picked = sample_top_k(row.expand(50_000, 10), 5, 1.0, gen)
    freq = torch.bincount(picked, minlength=10).float() / len(picked)
    expected = torch.cat([torch.softmax(-row[:5], 0), torch.zeros(5)])
    torch.testing.assert_close(freq, expected, atol=0.01, rtol=0)


@pytest.mark.parametrize("temperature", [0.0, 1e-6])
def test_vanishing_temperature_gives_the_nearest_code(temperature):
    gen = torch.Generator().manual_seed(2)
    dist = torch.rand(1000, 30, generator=gen)
    assert torch.equal(sample_top_k(dist, 5, temperature, gen), dist.argmin(1))

    draw = mixture(8, 4, scale=1.0, noise=1.0)
    vq = VQCodebook(8, temperature=temperature, init_size=64, reseed_after=None)
    vq.update(draw(64)[0])
    x = draw(500)[0]
    expected = vq.assign(x)
    assert torch.equal(vq.train_step(x).code, expected)


def test_spherical_kmeans_init_rescales_each_centre_to_its_members_mean_norm():
    gen = torch.Generator().manual_seed(3)
    directions = torch.eye(8)[:3]                                  # three orthogonal directions
    labels = torch.arange(3).repeat_interleave(100)
    norms = torch.cat([torch.rand(100, generator=gen) * 2 + 1, torch.rand(100, generator=gen) * 20 + 10,
                       torch.rand(100, generator=gen) * 50 + 100])
    units = F.normalize(directions[labels] + 0.05 * torch.randn(300, 8, generator=gen), dim=1)
    x = units * norms[:, None]
    vq = VQCodebook(3, init="spherical_kmeans", init_size=300)
    vq.update(x)
    for code in vq.codes:
        j = int((code @ directions.T).argmax())
        members = labels == j
        expected = F.normalize(units[members].mean(0), dim=0) * norms[members].mean()
        torch.testing.assert_close(code, expected, atol=1e-4, rtol=1e-5)


def test_kmeans_init_finds_the_cluster_means():
    draw = mixture(6, 5, scale=10.0, noise=0.5, seed=4)
    x, labels = draw(600)
    vq = VQCodebook(6, init="kmeans", init_size=600)
    vq.update(x)
    means = torch.stack([x[labels == j].mean(0) for j in range(6)])
    match = torch.cdist(vq.codes, means).argmin(1)
    assert sorted(match.tolist()) == list(range(6))
    torch.testing.assert_close(vq.codes, means[match], atol=1e-4, rtol=1e-5)


def test_codebook_usage_on_a_stream_from_a_gaussian_mixture():
    draw = mixture(64, 32, seed=5)
    vq = VQCodebook(64, batch_size=512)
    for _ in range(60):
        vq.update(draw(600)[0])
    stats = vq.stats()
    x, _ = draw(4000)
    used = vq.assign(x).unique().numel() / 64
    err = (x - vq.quantize(x)).pow(2).sum() / (x - x.mean(0)).pow(2).sum()
    assert stats.usage > 0.9 and used > 0.9, (stats, used)
    assert stats.perplexity > 0.9 * 64
    # noise floor 0.3^2 * 32 / 803 = 0.0036; each pair of merged clusters adds about 0.008
    assert err.item() < 0.03 and stats.fvu == pytest.approx(err.item(), rel=0.2)


def test_dead_codes_are_reseeded_with_recent_tokens():
    vq = VQCodebook(4, decay=0.5, top_k=1, init="random", init_size=4, batch_size=8, buffer_size=8,
                    reseed_after=10)
    vq.update(torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
    far = torch.tensor([100.0, 100.0]) + torch.arange(16.0).view(8, 2)      # only one code is hit
    for _ in range(9):
        vq.update(far)
    assert vq.stats().usage == 0.25
    vq.update(far)                                        # 10th step: the three others are dead
    near_far = torch.cdist(vq.codes, far).min(1).values
    assert (near_far[vq.counts.argsort()[:3]] == 0).all()   # reborn codes are tokens of the batch
    assert vq.stats().usage == 1.0


def _stream(seed: int = 6):
    draw = mixture(16, 8, scale=1.0, noise=0.5, seed=seed)
    return [draw(37 + 13 * (i % 5))[0] for i in range(30)]


def _make() -> VQCodebook:
    return VQCodebook(16, top_k=5, temperature=1.0, init_size=64, batch_size=50, reseed_after=5,
                      seed=11)


@pytest.mark.parametrize("stop", [1, 15])
def test_resume_from_a_saved_state_is_bit_identical(tmp_path, stop):
    stream = _stream()
    whole = _make()
    for x in stream:
        whole.update(x)
    first = _make()
    for x in stream[:stop]:
        first.update(x)
    torch.save(first.state_dict(), tmp_path / "vq.pt")
    resumed = _make()
    resumed.load_state_dict(torch.load(tmp_path / "vq.pt", weights_only=True))
    for x in stream[stop:]:
        resumed.update(x)
    assert whole.steps > 20
    assert_same_state(whole.state_dict(), resumed.state_dict())


def test_batches_mix_the_buffer_and_flush_trains_on_the_rest():
    vq = VQCodebook(2, top_k=1, init="random", init_size=2, batch_size=4, buffer_size=8,
                    reseed_after=None)
    vq.update(torch.tensor([[0.0], [10.0]]))
    for start in range(0, 12, 3):                   # 12 rows in calls of 3: steps at 8, 11, 12 held
        vq.update(torch.arange(start, start + 3.0)[:, None])
    assert vq.steps == 2 and len(vq._mixer) == 4
    vq.flush()
    assert vq.steps == 3 and vq.tokens == 12 and len(vq._mixer) == 0

    short = VQCodebook(4, init_size=100)
    short.update(torch.randn(10, 3))
    short.flush()                                   # fewer than init_size: initialises on what it has
    assert short.codes.shape == (4, 3) and short.steps == 0


def test_merge_adds_what_replicas_learnt_since_their_shared_start():
    stream = _stream()
    a = VQCodebook(16, eps=0.0, init_size=64, batch_size=50, reseed_after=None)
    a.update(torch.cat(stream[:2])[:64])
    start = a.fitted.counts.clone(), a.fitted.sums.clone(), a.fitted.hits.clone()
    b = VQCodebook(16, eps=0.0, init_size=64, batch_size=50, reseed_after=None)
    b.load_state_dict(a.state_dict())
    for x in stream[1:10]:
        a.update(x)
    for x in stream[10:20]:
        b.update(x)
    merged = VQCodebook(16, eps=0.0, init_size=64, batch_size=50, reseed_after=None)
    merged.merge(a)
    torch.testing.assert_close(merged.codes, a.codes)            # into an empty one: a copy
    merged.merge(b.state_dict())
    w = 0.99 ** b.steps  # b's decayed copy of the shared start, counted once
    torch.testing.assert_close(merged.counts, a.counts + b.counts - w * start[0])
    torch.testing.assert_close(merged.fitted.sums, a.fitted.sums + b.fitted.sums - w * start[1])
    assert torch.equal(merged.fitted.hits, a.fitted.hits + b.fitted.hits - start[2])
    assert merged.steps == max(a.steps, b.steps) and merged.tokens == a.tokens + b.tokens
    assert merged._mixer.count == a._mixer.count + b._mixer.count  # buffered rows join
    with pytest.raises(ValueError, match="cannot merge"):
        merged.merge(VQCodebook(8))


def test_merge_keeps_the_rows_either_side_holds_for_its_initialisation():
    rows = torch.cat(_stream()[:4])[:120]
    make = lambda: VQCodebook(16, init_size=64, batch_size=50, reseed_after=None)  # noqa: E731
    a, b, alone = make(), make(), make()
    a.update(rows[:40])
    b.update(rows[40:80])
    a.merge(b)  # both still waiting: a initialises on all 80 rows, as one fed both
    alone.update(rows[:40])
    alone.update(rows[40:80])
    assert a.fitted is not None and torch.equal(a.codes, alone.codes) and a.tokens == alone.tokens
    waiting, fitted, twin = make(), make(), make()
    waiting.update(rows[80:120])
    fitted.update(rows[:80])
    twin.load_state_dict(fitted.state_dict())
    waiting.merge(fitted)  # a copy of the fitted one, then its own 40 waiting rows
    twin.update(rows[80:120])
    assert torch.equal(waiting.codes, twin.codes) and waiting.tokens == twin.tokens


@pytest.mark.parametrize("sizes", [(50, 20), (7, 64), (33, 33)])  # uneven shards
def test_merge_after_one_step_each_equals_one_step_on_both(sizes):
    draw = mixture(8, 6, seed=3)
    init, (x1, x2) = draw(64)[0], (draw(n)[0] for n in sizes)
    make = lambda: VQCodebook(8, top_k=1, init_size=64, reseed_after=None)  # noqa: E731 - nearest code
    a = make()
    a.update(init)
    b, whole = make(), make()
    b.load_state_dict(a.state_dict())
    whole.load_state_dict(a.state_dict())
    a.update(x1)
    b.update(x2)
    whole.update(torch.cat([x1, x2]))
    a.merge(b)
    for key in ("counts", "sums", "codes", "fvu"):
        torch.testing.assert_close(getattr(a.fitted, key), getattr(whole.fitted, key), rtol=1e-5, atol=1e-6)
    assert torch.equal(a.fitted.hits, whole.fitted.hits) and (a.steps, a.tokens) == (whole.steps, whole.tokens)


def test_perplexity_and_pooled_fvu_by_hand():
    # p = (1/4, 1/4, 1/2, 0): entropy 1.5 ln 2, perplexity 2 ** 1.5
    assert perplexity(torch.tensor([1.0, 1.0, 2.0, 0.0])).item() == pytest.approx(2 ** 1.5)
    gen = torch.Generator().manual_seed(7)
    x, x_hat = torch.randn(2, 50, 3, generator=gen)
    pooled = fvu_sums(x[:20], x_hat[:20]) + fvu_sums(x[20:], x_hat[20:])
    direct = ((x - x_hat).pow(2).sum() / (x - x.mean(0)).pow(2).sum()).item()
    assert fvu_from_sums(pooled) == pytest.approx(direct, rel=1e-6)


def test_concept_set_holds_the_codes_and_round_trips(tmp_path):
    draw = mixture(8, 6)
    vq = VQCodebook(8, init_size=64)
    for _ in range(5):
        vq.update(draw(100)[0])
    x = draw(20)[0]
    enc = vq.encode(x)
    assert enc.shape == (20, 8) and torch.equal(enc.argmax(1), vq.assign(x)) and (enc.sum(1) == 1).all()
    cs = vq.concept_set()
    assert cs.method == "vq" and cs.site is None and torch.equal(cs.directions, vq.codes)
    loaded = ConceptSet.load(cs.save(tmp_path / "cs"))
    assert torch.equal(loaded.encoder["codebook"], vq.codes) and loaded.config["n_codes"] == 8
    assert math.isfinite(loaded.config["fit_stats"]["fvu"])


def test_bad_settings_and_inputs_are_named():
    with pytest.raises(ValueError, match="init must be one of"):
        VQCodebook(8, init="pca")
    with pytest.raises(ValueError, match="init_size=4 is smaller than n_codes=8"):
        VQCodebook(8, init_size=4)
    with pytest.raises(ValueError, match="decay"):
        VQCodebook(8, decay=1.0)
    vq = VQCodebook(8, init_size=16)
    vq.update(torch.randn(10, 3))
    assert math.isnan(vq.stats().fvu) and vq.stats().tokens == 0      # a report, not an error
    with pytest.raises(RuntimeError, match="seen 10 tokens"):
        vq.encode(torch.randn(2, 3))
    with pytest.raises(ValueError, match="expected width d=3"):
        vq.update(torch.randn(4, 5))


@pytest.mark.parametrize("distance, share", [("squared", math.exp(-4) / (math.exp(-1) + math.exp(-4))),
                                             ("euclidean", math.exp(-2) / (math.exp(-1) + math.exp(-2)))])
def test_a_training_step_draws_over_the_squared_distance_as_the_clvq_code(distance, share):
    """Codes at distances 1 and 2 from every row: at T = 1 the farther is drawn with probability
    e^-4 / (e^-1 + e^-4) = 0.047 over squared distances (the CLVQ-VAE quantiser, the default) and
    e^-2 / (e^-1 + e^-2) = 0.269 over Euclidean ones (`distance="euclidean"`, older codebooks)."""
    vq = VQCodebook(2, top_k=2, temperature=1.0, init="random", init_size=2, reseed_after=None, seed=3,
                    **({} if distance == "squared" else {"distance": distance}))
    vq.update(torch.tensor([[1.0, 0.0], [2.0, 0.0]]))  # the codes: the two init rows
    assert sorted(vq.codes[:, 0].tolist()) == [1.0, 2.0]
    far = int(vq.codes[:, 0].argmax())
    step = vq.train_step(torch.zeros(40_000, 2))
    assert (step.code == far).float().mean().item() == pytest.approx(share, abs=0.01)
