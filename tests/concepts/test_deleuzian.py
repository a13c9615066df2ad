import pytest
import scipy.stats
import torch

from conceptlens.concepts.deleuzian import Deleuzian, oriented_differences, reservoir_update, skewness


def effective_rank(c: torch.Tensor) -> float:
    """exp(entropy) of the normalised singular values."""
    s = torch.linalg.svdvals(c.double())
    q = s / s.sum()
    return float(torch.exp(-(q * q.clamp_min(1e-300).log()).sum()))


def fit(x, k, chunk=2000, **kw):
    dz = Deleuzian(k, buffer_size=2048, batch_size=512, reference_size=2048, **kw)
    for part in x.split(chunk):
        dz.update(part)
    return dz


def test_reservoir_is_algorithm_r():
    x = torch.arange(50, dtype=torch.float32)[:, None].repeat(1, 2)
    got = torch.zeros(8, 2)
    seen = 0
    gen = torch.Generator().manual_seed(0)
    for part in x.split([3, 10, 1, 20, 16]):
        seen = reservoir_update(got, seen, part, gen)
    # The sequential algorithm, fed the same uniform draws in the same order.
    ref, replay = torch.zeros(8, 2), torch.Generator().manual_seed(0)
    t = 0
    for part in x.split([3, 10, 1, 20, 16]):
        fill = max(0, min(8 - t, len(part)))
        u = torch.rand(len(part) - fill, generator=replay, dtype=torch.float64) if fill < len(part) else None
        for i, row in enumerate(part):
            if t < 8:
                ref[t] = row
            else:
                j = int(u[i - fill] * (t + 1))
                if j < 8:
                    ref[j] = row
            t += 1
    assert seen == 50 and torch.equal(got, ref)


def test_reservoir_keeps_each_row_with_equal_probability():
    counts = torch.zeros(40)
    for seed in range(1500):
        res, gen = torch.zeros(5, 1), torch.Generator().manual_seed(seed)
        seen = 0
        for part in torch.arange(40.0)[:, None].split(7):
            seen = reservoir_update(res, seen, part, gen)
        counts[res[:, 0].long()] += 1
    # 5/40 = 0.125 per row; binomial sd 0.0085.
    assert torch.allclose(counts / 1500, torch.full((40,), 0.125), atol=0.04)


def test_skewness_matches_scipy():
    g = torch.Generator().manual_seed(0)
    x, dirs = torch.randn(500, 6, generator=g).exp(), torch.randn(4, 6, generator=g)
    ref = scipy.stats.skew((x @ dirs.T).double().numpy(), axis=0)
    assert torch.allclose(skewness(x, dirs).double(), torch.from_numpy(ref), atol=1e-4)


def test_differences_use_each_token_once_per_side_oriented_and_weighted():
    g = torch.Generator().manual_seed(0)
    ref, block = torch.randn(400, 5, generator=g).exp(), torch.randn(64, 5, generator=g).exp()
    block[10] = block[9]  # a zero difference: undefined skewness, weight 0
    diff, w = oriented_differences(block, ref)
    raw = block - block.roll(1, 0)
    sign = torch.where((diff * raw).sum(1) < 0, -1.0, 1.0)
    assert torch.allclose(diff, raw * sign[:, None])
    g_skew = skewness(ref, diff)
    assert (g_skew[w > 0] > 0).all()
    assert w[10] == 0 and torch.allclose(w[w > 0], 1 / g_skew[w > 0].abs())
    plain, ones = oriented_differences(block, ref, skew_weighting=False)
    assert torch.equal(plain, diff) and torch.equal(ones, torch.ones(64))


def planted(n, d=32, k=6, p=0.1, amp=5.0, noise=0.3, seed=0):
    """base + sparse on/off concepts + noise: differences of two rows are mostly +-one concept."""
    g = torch.Generator().manual_seed(seed)
    concepts = torch.linalg.qr(torch.randn(d, d, generator=g))[0][:k]
    on = (torch.rand(n, k, generator=g) < p).float()
    x = 2 * torch.randn(d, generator=g) + amp * on @ concepts + noise * torch.randn(n, d, generator=g)
    return x, concepts


def test_recovers_planted_difference_directions():
    x, concepts = planted(12000)
    dz = fit(x, 12, skew_weighting=False, seed=0)
    cos = torch.nn.functional.normalize(dz.centroids, dim=1) @ concepts.T
    # +-c differences are flipped onto +c (sparse concepts project with positive skew).
    assert cos.max(0).values.min() > 0.95, cos.max(0).values


def test_skew_weighting_spreads_centroids_off_a_heavy_tailed_direction():
    """One rare, huge, very skewed direction (like a massive activation) plus six common
    concepts (p = 0.3, low skew). Unweighted, several centroids describe the huge direction;
    1/|skew| weights take them off it, so the centroid matrix has a higher effective rank."""
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(16, 16, generator=g))[0]
    common = (torch.rand(8000, 6, generator=g) < 0.3).float() @ (3 * basis[1:7])
    rare = (torch.rand(8000, 1, generator=g) < 0.02).float() * (40 * basis[0])
    x = common + rare + 0.1 * torch.randn(8000, 16, generator=g)
    weighted, plain = fit(x, 8, skew_weighting=True), fit(x, 8, skew_weighting=False)
    on_rare = lambda dz: int(((torch.nn.functional.normalize(dz.centroids, dim=1) @ basis[0]).abs() > 0.5).sum())
    assert on_rare(weighted) < on_rare(plain)
    assert effective_rank(weighted.centroids) > 1.3 * effective_rank(plain.centroids)


def test_encode_is_projection_on_centroids_and_reading_changes_nothing():
    x, _ = planted(3000, d=8, k=3)
    dz = fit(x, 4, chunk=1000)
    assert len(dz.buffer) > 0  # some tokens not yet paired: reading pairs them on a copy
    before = dz.state_dict()
    cs = dz.concept_set()
    assert cs.method == "deleuzian" and cs.config["skew_weighting"] is True and cs.site is None
    assert torch.allclose(dz.encode(x[:5]), x[:5] @ cs.directions.T)
    after = dz.state_dict()
    assert torch.equal(before["buffer"]["data"], after["buffer"]["data"])
    assert torch.equal(before["generator"], after["generator"])
    dz.flush()
    assert len(dz.buffer) == 0 and torch.equal(dz.centroids, cs.directions)


def test_merge_pools_reference_and_kmeans_mass():
    x, _ = planted(6000, d=8, k=3)
    a, b = fit(x[:3000], 4, chunk=1000, seed=0), fit(x[3000:], 4, chunk=1000, seed=1)
    a.flush(), b.flush()
    mass = float(a.kmeans.mass.sum() + b.kmeans.mass.sum())
    a.merge(b)
    assert a.n_seen == 6000 and a.reference.shape == (2048, 8)
    assert float(a.kmeans.mass.sum()) == pytest.approx(mass)
    with pytest.raises(ValueError, match="merge 5 concepts into 4"):
        a.merge(Deleuzian(5))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="batch_size"):
        Deleuzian(4, batch_size=1)
    with pytest.raises(ValueError, match="reference_size"):
        Deleuzian(4, reference_size=0)
    dz = Deleuzian(4)
    with pytest.raises(ValueError, match="no data"):
        dz.reference
    dz.update(torch.randn(10, 3))
    with pytest.raises(ValueError, match="width d=3"):
        dz.update(torch.randn(10, 4))


def test_streaming_skewness_is_over_a_fresh_uniform_subsample_of_the_reservoir(monkeypatch):
    """Each block's weights are the population skewness (scipy's) of the differences'
    projections over `rows_for_skewness` distinct reservoir rows, drawn afresh per block."""
    import conceptlens.concepts.deleuzian as module

    calls, holder = [], []
    real = module.oriented_differences

    def spy(block, reference, skew_weighting=True):
        out = real(block, reference, skew_weighting)
        calls.append((block.clone(), reference.clone(), *out, holder[0].reference.clone()))
        return out

    monkeypatch.setattr(module, "oriented_differences", spy)
    x, _ = planted(6000, d=8, k=3)
    dz = Deleuzian(4, reference_size=1024, buffer_size=512, batch_size=256, skew_rows=300, seed=0)
    holder.append(dz)
    assert dz.config.rows_for_skewness == 300
    for part in x.split(500):
        dz.update(part)
    assert len(calls) > 10
    for block, ref, diff, w, reservoir in calls[-10:]:  # the reservoir is full: 300 of its 1024 rows each time
        assert ref.shape == (300, 8) and torch.unique(ref, dim=0).shape[0] == 300
        match = (ref[:, None, :] == reservoir[None]).all(-1)  # (300, 1024): rows of the reservoir then
        assert (match.sum(1) >= 1).all()
        raw = (block - block.roll(1, 0)).double()
        g = scipy.stats.skew((ref.double() @ raw.T).numpy(), axis=0)  # the reference estimator
        g = torch.from_numpy(g) * torch.sign((diff.double() * raw).sum(1))  # oriented: flipped rows flip g
        assert torch.allclose(1 / w.double(), g.abs(), rtol=1e-4, atol=1e-5)  # |g| (w = 1/|g| near g = 0 is ill-posed)
        assert (g > 0).all()
    assert len({tuple(r[1][0].tolist()) for r in calls[-10:]}) == 10  # a fresh draw for every block
    small = Deleuzian(4, reference_size=1024)
    assert small.config.rows_for_skewness == 256  # the floor below k = 256
    assert Deleuzian(512).config.rows_for_skewness == 512  # k rows: the k-means step's cost
    assert Deleuzian(512, skew_rows=10_000, reference_size=4096).config.rows_for_skewness == 4096


def test_whole_reservoir_when_skew_rows_is_reference_size():
    x, _ = planted(4000, d=8, k=3)
    a = Deleuzian(4, reference_size=512, buffer_size=512, batch_size=256, skew_rows=512, seed=0)
    for part in x.split(500):
        a.update(part)
    block = x[:256]
    diff, w = oriented_differences(block, a.reference)
    assert torch.allclose(w, 1 / skewness(a.reference, diff).abs())
    assert a._skew_reference() is not None and torch.equal(a._skew_reference(), a.reference)


def test_bf16_skewness_close_to_float32():
    g = torch.Generator().manual_seed(0)
    # rows whose mean is of the order of their spread, as residual streams' coordinates (bf16 keeps
    # 8 bits: rows far from the origin relative to their spread lose more of their shape)
    ref, dirs = 2 + torch.randn(2048, 16, generator=g).exp(), torch.randn(64, 16, generator=g)
    full, low = skewness(ref, dirs), skewness(ref.bfloat16(), dirs)
    assert low.dtype == torch.float32
    assert (full - low).abs().max() < 0.05, (full - low).abs().max()


def test_streaming_blocks_read_nothing_back_from_the_device(monkeypatch):
    # The weights Deleuzian hands its k-means are finite and >= 0 by construction: checking
    # them would be a host read (bool of a device tensor) every block, which stalls a GPU.
    reads = []

    def counted(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            reads.append(name)
            return original(self, *args, **kwargs)
        return read

    for name in ("__bool__", "item", "tolist", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    dz = Deleuzian(8, reference_size=256, buffer_size=512, batch_size=256, reseed_after=None)
    x = torch.randn(6000, 16, generator=torch.Generator().manual_seed(0))
    dz.update(x[:2000])  # the k-means initialises here (a one-off, allowed to read)
    reads.clear()
    steps = dz.kmeans.n_steps
    dz.update(x[2000:])
    assert dz.kmeans.n_steps > steps + 10 and reads == []


def test_paper_mode_refuses_a_comm_it_could_not_use():
    from conceptlens.distributed import Comm

    with pytest.raises(ValueError, match=r"mode='paper'.*no per-step statistics.*mode='streaming'"):
        Deleuzian(4, mode="paper").comm = Comm.__new__(Comm)  # (no group needed: refused before any use)
    streaming = Deleuzian(4)
    streaming.comm = None
    assert streaming.comm is None
