"""Extractors in a chosen compute dtype: bfloat16 fits agree with float32 fits on planted data,
accumulators stay float32 (or wider), bf16 and fp32 rows both work, resume is bit-identical in
bfloat16, merges keep working, and a bad dtype name gives a one-line error."""

import pytest
import torch

from conceptlens.concepts import Deleuzian, StreamingKMeans, VQCodebook
from conceptlens.concepts.clvq import CLVQTranscoder
from conceptlens.concepts.sae import (ActMSAE, BatchTopKSAE, EWGSAE, HSAE, JumpReLUSAE, MatryoshkaSAE, MPSAE, ReLUSAE,
                                      SpaDE, TopKSAE)
from tests.concepts.test_protocol import roundtrip

SAE = dict(width=64, batch_size=256, warmup_tokens=256, dead_after=5000)
SAES = {
    "relu": lambda **kw: ReLUSAE(**SAE, l1=0.2, **kw),
    "topk": lambda **kw: TopKSAE(**SAE, k=3, **kw),
    "batchtopk": lambda **kw: BatchTopKSAE(**SAE, k=3, **kw),
    "jumprelu": lambda **kw: JumpReLUSAE(**SAE, **kw),
    "spade": lambda **kw: SpaDE(**SAE, **kw),
    "matryoshka": lambda **kw: MatryoshkaSAE(**SAE, k=3, prefixes=(16, 32, 64), **kw),
    "actmsae": lambda **kw: ActMSAE(**SAE, k=3, ks=(3, 12, 64), **kw),
    "ewg": lambda **kw: EWGSAE(**SAE, groups=(8, 32, 64), l1=0.3, **kw),
    "mp": lambda **kw: MPSAE(**SAE, k=3, **kw),
    "hsae": lambda **kw: HSAE(parents=16, children=2, subspace=4, k=3, batch_size=256, warmup_tokens=256,
                              dead_after=5000, **kw),
}
OTHERS = {
    "kmeans": lambda **kw: StreamingKMeans(8, batch_size=256, **kw),
    "deleuzian": lambda **kw: Deleuzian(8, reference_size=512, buffer_size=1024, batch_size=256, **kw),
    "deleuzian_paper": lambda **kw: Deleuzian(8, reference_size=512, buffer_size=1024, batch_size=256, mode="paper",
                                              max_differences=2048, max_iter=20, **kw),
    "vq": lambda **kw: VQCodebook(8, batch_size=256, **kw),
}
ALL = {**OTHERS, **{f"sae_{k}": v for k, v in SAES.items()}}


def clusters(n: int, d: int = 16, k: int = 8, seed: int = 0) -> torch.Tensor:
    """k well-separated clusters far from the origin (a residual stream has a large mean)."""
    g = torch.Generator().manual_seed(seed)
    centres = 40 + 6 * torch.randn(k, d, generator=g)
    return centres[torch.randint(k, (n,), generator=g)] + torch.randn(n, d, generator=g)


def dictionary(n: int, d: int = 16, atoms: int = 32, seed: int = 0) -> torch.Tensor:
    """Rows that are sums of 3 of `atoms` unit atoms (coefficients in [0.5, 1.5]) plus an offset."""
    g = torch.Generator().manual_seed(seed)
    a = torch.nn.functional.normalize(torch.randn(atoms, d, generator=g), dim=1)
    chosen = torch.rand(n, atoms, generator=g).argsort(1)[:, :3]
    codes = torch.zeros(n, atoms).scatter(1, chosen, 0.5 + torch.rand(n, 3, generator=g))
    return codes @ a + 2.0


def feed(ex, x, chunk=500):
    for i, part in enumerate(x.split(chunk)):
        ex.update(part.bfloat16() if i % 2 else part)  # bf16 and fp32 rows alike
    ex.flush()
    return ex


def fvu(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    return float((x - x_hat).pow(2).sum() / (x - x.mean(0)).pow(2).sum())


@pytest.mark.parametrize("name", ALL)
def test_bad_dtype_is_one_line_naming_the_choices(name):
    with pytest.raises(ValueError, match=r"dtype must be one of \('float32', 'bfloat16'\); got 'float16'") as err:
        ALL[name](dtype="float16")
    assert "\n" not in str(err.value)
    assert ALL[name](dtype=torch.bfloat16).config.dtype == "bfloat16"  # a torch dtype is taken by name


def test_kmeans_bf16_inertia_within_half_a_percent_and_float32_centres():
    x = clusters(8000)
    inertia = {}
    for dtype in ("float32", "bfloat16"):
        km = feed(StreamingKMeans(8, batch_size=256, seed=0, dtype=dtype), x)
        assert km._centres.dtype == torch.float32 and km._mass.dtype == torch.float64
        inertia[dtype] = km.inertia(x)
    assert inertia["bfloat16"] <= 1.005 * inertia["float32"], inertia


def test_vq_bf16_fvu_within_one_percent_and_float32_ema():
    x = clusters(8000)
    out = {}
    for dtype in ("float32", "bfloat16"):
        vq = feed(VQCodebook(8, batch_size=256, seed=0, dtype=dtype), x)
        fit = vq.fitted
        assert fit.counts.dtype == fit.sums.dtype == fit.codes.dtype == torch.float32
        assert fit.hits.dtype == torch.int64 and fit.fvu.dtype == torch.float64
        out[dtype] = fvu(x, vq.quantize(x))
    assert out["bfloat16"] <= out["float32"] * 1.01 + 1e-4, out


@pytest.mark.parametrize("mode", ["streaming", "paper"])
def test_deleuzian_bf16_recovers_what_fp32_recovers(mode):
    g = torch.Generator().manual_seed(0)
    concepts = torch.linalg.qr(torch.randn(32, 32, generator=g))[0][:6]
    on = (torch.rand(12000, 6, generator=g) < 0.1).float()
    x = 2 * torch.randn(32, generator=g) + 5 * on @ concepts + 0.3 * torch.randn(12000, 32, generator=g)
    best = {}
    for dtype in ("float32", "bfloat16"):
        dz = feed(Deleuzian(12, skew_weighting=False, seed=0, mode=mode, dtype=dtype, max_differences=12000), x, 2000)
        if mode == "streaming":
            assert dz._reference.dtype == torch.bfloat16 if dtype == "bfloat16" else torch.float32
            assert dz.kmeans._centres.dtype == torch.float32 and dz.kmeans._mass.dtype == torch.float64
        else:  # paper mode keeps the paper's precision whatever the dtype
            assert dz._reference.dtype == torch.float32 and dz.differences.rows.dtype == torch.float32
        cos = torch.nn.functional.normalize(dz.centroids, dim=1) @ concepts.T
        best[dtype] = cos.max(0).values.min().item()
    assert best["float32"] > 0.95 and best["bfloat16"] > 0.95, best


@pytest.mark.parametrize("name", SAES)
def test_sae_bf16_fvu_close_to_fp32_with_float32_masters_and_adam(name):
    x = dictionary(12_000)
    x, held = x[:10_000], x[10_000:]
    out = {}
    for dtype in ("float32", "bfloat16"):
        sae = feed(SAES[name](seed=0, dtype=dtype), x)
        for p in sae.params.values():
            assert p.dtype == torch.float32
            state = sae.trainer.optimizer.state[p]
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
        assert sae.trainer.tracker.fired.dtype == torch.int64
        assert all(b.dtype in (torch.float32, torch.int64) for b in sae.buffer_dict.values())
        out[dtype] = fvu(held, sae.reconstruct(held))
    # bf16 compute rounds each product to 8 bits of mantissa: the fits differ by about a
    # thousandth of FVU here (at most 0.0013 over the variants); 0.01 absolute bounds them
    assert abs(out["bfloat16"] - out["float32"]) < 0.01, out


def test_clvq_bf16_trains_with_float32_parameters_and_close_fvu():
    g = torch.Generator().manual_seed(0)
    src = clusters(6000, d=16)
    tgt = src @ torch.randn(16, 8, generator=g) / 4
    out = {}
    for dtype in ("float32", "bfloat16"):
        tc = CLVQTranscoder(8, hidden=32, batch_size=256, seed=0, dtype=dtype)
        for i, (a, b) in enumerate(zip(src.split(500), tgt.split(500))):
            tc.update(a.bfloat16() if i % 2 else a, b)
        tc.flush()
        assert all(p.dtype == torch.float32 for p in tc.parts.decoder.parameters())
        assert all(s["exp_avg"].dtype == torch.float32 for s in tc.parts.optimizer.state.values())
        out[dtype] = fvu(tgt, tc.reconstruct(src))
    assert abs(out["bfloat16"] - out["float32"]) < 0.01, out


def _directions(ex):
    return ex.concept_set().directions


@pytest.mark.parametrize("name", ALL)
def test_bf16_resume_is_bit_identical_and_the_state_keeps_the_dtype(name):
    x = dictionary(4000) if name.startswith("sae") else clusters(4000)
    full = ALL[name](dtype="bfloat16")
    for part in x.split(500):
        full.update(part)
    first = ALL[name](dtype="bfloat16")
    for part in x[:1500].split(500):
        first.update(part)
    state = roundtrip(first.state_dict())
    config = state["_extra_state"]["config"] if "_extra_state" in state else state["config"]  # (an SAE: a module's)
    assert config["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="dtype"):  # a float32 object refuses a bfloat16 state
        ALL[name]().load_state_dict(state)
    resumed = type(first).from_state(state)
    assert resumed.config.dtype == "bfloat16"
    for part in x[1500:].split(500):
        resumed.update(part)
    assert torch.equal(_directions(full), _directions(resumed))


@pytest.mark.parametrize("name", ["kmeans", "deleuzian", "vq", "sae_topk"])
def test_bf16_merge_keeps_working_and_float32(name):
    x = dictionary(4000) if name.startswith("sae") else clusters(4000)
    a = ALL[name](dtype="bfloat16")
    a.update(x[:2000])
    b = type(a).from_state(a.state_dict())  # a replica of one start (what SAE and VQ merges want)
    a.update(x[2000:3000])
    b.update(x[3000:])
    a.merge(b.state_dict())
    assert _directions(a).dtype == torch.float32 and torch.isfinite(_directions(a)).all()


def test_float32_states_saved_before_the_dtype_field_still_load():
    km = feed(StreamingKMeans(8, batch_size=256), clusters(2000))
    state = km.state_dict()
    del state["config"]["dtype"]
    assert torch.equal(StreamingKMeans.from_state(state).centres, km.centres)


def test_clvq_bf16_resume_is_bit_identical_and_merge_works():
    g = torch.Generator().manual_seed(1)
    src = clusters(3000, d=16)
    tgt = src @ torch.randn(16, 8, generator=g) / 4
    make = lambda: CLVQTranscoder(8, hidden=32, batch_size=256, seed=0, dtype="bfloat16")  # noqa: E731
    full, first = make(), make()
    for a, b in zip(src.split(500), tgt.split(500)):
        full.update(a, b)
    for a, b in zip(src[:1500].split(500), tgt[:1500].split(500)):
        first.update(a, b)
    state = roundtrip(first.state_dict())
    assert state["config"]["dtype"] == "bfloat16"
    resumed = CLVQTranscoder.from_state(state)
    replica = CLVQTranscoder.from_state(state)
    for a, b in zip(src[1500:].split(500), tgt[1500:].split(500)):
        resumed.update(a, b)
    assert torch.equal(full.concept_set().directions, resumed.concept_set().directions)
    replica.update(src[:500], tgt[:500])
    resumed.merge(replica.state_dict())
    assert all(p.dtype == torch.float32 for p in resumed.parts.encoder.parameters())
    assert torch.isfinite(resumed.concept_set().directions).all()


def test_bf16_kmeans_and_vq_reseed_dead_centres_into_float32():
    x = clusters(6000, k=4)  # 16 centres on 4 clusters
    # outliers among the first rows seed centres that no later row reaches: they starve and are reseeded
    x[:8] += 100 * torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    km = StreamingKMeans(16, batch_size=256, reseed_after=1.0, seed=0, dtype="bfloat16")
    feed(km, x)
    assert km.n_reseeded > 0 and km._centres.dtype == torch.float32
    vq = VQCodebook(16, batch_size=128, reseed_after=2, reseed_threshold=0.5, top_k=1, seed=0, dtype="bfloat16")
    feed(vq, x)
    assert vq.fitted.codes.dtype == vq.fitted.sums.dtype == torch.float32 and torch.isfinite(vq.fitted.codes).all()


def test_clvq_codebook_takes_the_transcoders_dtype_not_its_own():
    assert CLVQTranscoder(8, dtype="bfloat16").vq.config.dtype == "bfloat16"
    with pytest.raises(ValueError, match="unknown codebook options \\['dtype'\\]"):
        CLVQTranscoder(8, codebook={"dtype": "bfloat16"})


def test_bf16_skewness_centres_in_float32_so_a_large_mean_does_not_bias_it():
    # Rows with a mean far above their spread (a residual stream's massive dimension): in
    # bfloat16 the projections' mean must not be rounded before it is taken off, or the third
    # moment picks up 3 * rounding * variance, a bias of order 1 on symmetric data.
    from conceptlens.concepts.deleuzian_math import skewness

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=g)
    x[:, 0] += 300.3
    x[:, 1:] += torch.distributions.Exponential(1.0).sample((63,))  # a mixed, non-uniform offset
    directions = torch.randn(32, 64, generator=g) + torch.eye(64)[0] * 3
    rows, directions = x.bfloat16(), directions.bfloat16()
    exact = skewness(rows.double(), directions.double())  # the same rounded rows, in float64
    assert (skewness(rows, directions).double() - exact).abs().max() < 0.01


@pytest.mark.parametrize("name", ["kmeans", "kmeans_batched_init", "vq"])
def test_bf16_distances_do_not_depend_on_a_large_common_offset(name):
    # Squared distances are translation invariant; in bfloat16 the product x.c is rounded on
    # the scale of |x||c|, so a mean far above the clusters' spread (300 on one coordinate,
    # |x|^2 ~ 9e4 against centre gaps ~ 1e3) must be taken off before the matmul.
    g = torch.Generator().manual_seed(0)
    centres = 3 * torch.randn(16, 64, generator=g)
    x = centres[torch.randint(16, (16000,), generator=g)] + torch.randn(16000, 64, generator=g)
    x[:, 0] += 300.0
    make = {"kmeans": lambda dt: StreamingKMeans(16, batch_size=512, seed=0, dtype=dt),
            "kmeans_batched_init": lambda dt: StreamingKMeans(16, batch_size=512, seed=0, init="batched", dtype=dt),
            "vq": lambda dt: VQCodebook(16, batch_size=512, top_k=1, seed=0, dtype=dt)}[name]
    out = {}
    for dtype in ("float32", "bfloat16"):
        ex = feed(make(dtype), x, 2000)
        out[dtype] = ex.inertia(x) if name.startswith("kmeans") else fvu(x, ex.quantize(x))
    assert out["bfloat16"] <= 1.01 * out["float32"], out


def test_bf16_vq_assigns_float32_rows_without_rounding_them():
    # Inference reads the float32 codes and the rows as given: a bf16 codebook's assign is
    # the float32 nearest code, not the nearest code of the rows rounded to bfloat16.
    g = torch.Generator().manual_seed(0)
    centres = 3 * torch.randn(16, 64, generator=g)
    x = centres[torch.randint(16, (4000,), generator=g)] + 2 * torch.randn(4000, 64, generator=g)
    x[:, 0] += 300.0  # bf16 rows are 2 apart here: enough to move near ties
    vq = feed(VQCodebook(16, batch_size=512, top_k=1, seed=0, dtype="bfloat16"), x, 1000)
    assert torch.equal(vq.assign(x), torch.cdist(x, vq.codes).argmin(1))
    assert torch.equal(vq.quantize(x), vq.codes[torch.cdist(x, vq.codes).argmin(1)])
