"""Crosscoders: planted features shared by several sites, bit-identical resume, exact merges, raw-space folding."""

import pytest
import torch

from conceptlens.concepts import ConceptSet
from conceptlens.concepts.sae.crosscoder import Crosscoder, ReLUCrosscoder, split_concept_set
from conceptlens.concepts.sae.multisite_io import multisite_from_concept_set

from tests.conftest import roundtrip

DIMS, SCALES, N_FEATURES, ACTIVE = (16, 12, 8), (1.0, 5.0, 0.3), 24, 3
SMALL = dict(width=16, batch_size=64, warmup_tokens=100, buffer_size=128, dead_after=200)
CLASSES = {"topk": (Crosscoder, dict(k=4)), "relu": (ReLUCrosscoder, {})}


def planted_sites(n: int, seed: int = 0):
    """Sparse features read at three sites of different widths and scales: token t holds ACTIVE of
    N_FEATURES features f in [0.5, 1.5]; site i holds scale_i f E_i + 1."""
    g = torch.Generator().manual_seed(seed)
    atoms = [torch.nn.functional.normalize(torch.randn(N_FEATURES, d, generator=g), dim=1) for d in DIMS]
    chosen = torch.rand(n, N_FEATURES, generator=g).argsort(1)[:, :ACTIVE]
    f = torch.zeros(n, N_FEATURES).scatter(1, chosen, 0.5 + torch.rand(n, ACTIVE, generator=g))
    return [s * (f @ E) + 1.0 for s, E in zip(SCALES, atoms)], atoms


def recovered(atoms, cs, cos=0.9):
    """Share of planted features some latent matches at EVERY site (cosine > `cos` per site block)."""
    blocks = split_concept_set(cs).values()
    sims = torch.stack([torch.nn.functional.normalize(E, dim=1) @ torch.nn.functional.normalize(b.directions, dim=1).T
                        for E, b in zip(atoms, blocks)])  # (sites, features, latents)
    return (sims.min(0).values.max(1).values > cos).float().mean().item()


def test_crosscoder_recovers_features_shared_by_the_sites():
    xs, atoms = planted_sites(22_000)
    cc = Crosscoder(width=48, k=ACTIVE, batch_size=256, warmup_tokens=512, seed=0)
    for _ in range(3):
        for chunk in zip(*[x[:20_000].split(1000) for x in xs]):
            cc.update(*chunk)
    share, fvus = recovered(atoms, cc.concept_set()), cc.fvu(*[x[20_000:] for x in xs])
    print(f"crosscoder: {share:.0%} of the planted features recovered at every site, held-out FVU per site "
          + ", ".join(f"{v:.3f}" for v in fvus))
    assert share >= 0.9
    assert max(fvus) < 0.2


def chunks(n_chunks=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(20, 90, (n_chunks,), generator=g).tolist()
    out = []
    for n in sizes:
        x = 3 + 5 * torch.randn(n, 10, generator=g).relu()
        out.append((x, (x[:, :6] * 2 - 1).relu() + 0.1 * torch.randn(n, 6, generator=g), 0.01 * x[:, 3:7]))
    return out


def feed(cc, parts):
    for xs in parts:
        cc.update(*xs)
    return cc


def make(name):
    cls, extra = CLASSES[name]
    return cls(**SMALL, **extra)



@pytest.mark.parametrize("name", CLASSES)
@pytest.mark.parametrize("cut", [1, 6])  # during warm-up, and after several steps
def test_resume_is_bit_identical(name, cut):
    parts = chunks()
    full = feed(make(name), parts)
    first = feed(make(name), parts[:cut])
    resumed = make(name)
    resumed.load_state_dict(roundtrip(first.state_dict()))
    feed(resumed, parts[cut:])
    assert full.stats().steps > 5
    for key in full.params:
        assert torch.equal(full.params[key], resumed.params[key]), key
    assert full.stats() == resumed.stats()
    probe = chunks(1, seed=9)[0]
    for a, b in zip(full.reconstruct(*probe), resumed.reconstruct(*probe)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", CLASSES)
def test_merge_averages_replicas_and_pools_warm_ups(name):
    base = feed(make(name), chunks()[:4])
    a, b = make(name), make(name)
    a.load_state_dict(base.state_dict())
    b.load_state_dict(base.state_dict())
    feed(a, chunks(seed=1)[:5])
    feed(b, chunks(seed=2)[:5])
    expected = {k: (a.params[k] + b.params[k]).detach() / 2 for k in a.params}
    a.merge(b.state_dict())
    for key, value in expected.items():
        if key == "W_dec" and a.unit_decoder:  # the average's rows are put back at unit norm
            value = value / value.norm(dim=1, keepdim=True)
        torch.testing.assert_close(a.params[key].detach(), value)
    # two replicas still warming up pool their per-site sums: the scales of one that saw both
    xs = [torch.cat(t) for t in zip(*chunks())]
    one = feed(make(name), [[x[:60] for x in xs], [x[60:100] for x in xs]])  # warm-up: 100 rows
    c, d = feed(make(name), [[x[:60] for x in xs]]), feed(make(name), [[x[60:100] for x in xs]])
    assert c.scale is None and d.scale is None
    c.merge(d)
    torch.testing.assert_close(c.buffer_dict["site_scale"], one.buffer_dict["site_scale"], rtol=0, atol=0)


@pytest.mark.parametrize("name", CLASSES)
def test_raw_space_fold_matches_the_training_space(name):
    cc = feed(make(name), chunks())
    xs = chunks(1, seed=5)[0]
    c = cc.columns()
    w = cc._weights()
    with torch.no_grad():
        x_n = torch.cat(xs, 1) * c
        z_n = cc._activate((x_n - w["b_dec"]) @ w["W_enc"] + w["b_enc"], w, train=False)
        y_n = z_n @ w["W_dec"] + w["b_dec"]
    torch.testing.assert_close(cc.encode(*xs), z_n, rtol=1e-4, atol=1e-5)
    for got, want in zip(cc.reconstruct(*xs), (y_n / c).split([10, 6, 4], 1)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    cs = cc.concept_set()
    assert cs.directions.shape == (16, 20) and cs.config["widths"] == [10, 6, 4]
    parts = split_concept_set(cs, ["a", "b", "c"])
    assert [p.directions.shape[1] for p in parts.values()] == [10, 6, 4] and parts["b"].site == "b"


def test_a_multi_site_sets_mean_is_split_with_its_directions():
    cs = feed(make("relu"), chunks()).concept_set()
    mean = torch.arange(20.0)
    with_mean = ConceptSet(cs.directions, cs.site, method=cs.method, config=cs.config, model=cs.model, mean=mean)
    parts = split_concept_set(with_mean, ["a", "b", "c"])
    for got, want in zip((p.mean for p in parts.values()), mean.split([10, 6, 4])):
        assert got is not None and torch.equal(got, want)
    assert all(p.mean is None for p in split_concept_set(cs, ["a", "b", "c"]).values())


def test_the_penalty_weighs_each_latent_by_its_summed_site_norms():
    cc = feed(make("relu"), chunks())
    xs = chunks(1, seed=5)[0]
    w = cc._weights()
    x_n = torch.cat(xs, 1) * cc.columns()
    code = cc._encode(x_n, w, train=True)
    blocks = w["W_dec"].split([10, 6, 4], 1)
    by_hand = sum(code.z[:, j] * sum(b[j].norm() for b in blocks) for j in range(16)).mean()
    torch.testing.assert_close(cc._penalty(x_n, x_n, code, w), cc.l1_now() * w["l1_unit"] * by_hand)


def test_bad_input_is_named():
    cc = make("topk")
    with pytest.raises(TypeError, match="one tensor per site"):
        cc.update(torch.zeros(4, 10))
    with pytest.raises(ValueError, match="same tokens"):
        cc.update(torch.zeros(4, 10), torch.zeros(5, 6))
    cc.update(torch.ones(4, 10), torch.ones(4, 6))
    with pytest.raises(ValueError, match=r"widths \[10, 6\]"):
        cc.update(torch.ones(4, 9), torch.ones(4, 6))


@pytest.mark.parametrize("name", CLASSES)
def test_saved_set_rebuilds_the_same_crosscoder(name, tmp_path):
    """SAELens 6.54 has no crosscoder class: the round trip is through our own ConceptSet files."""
    cc = feed(make(name), chunks())
    cc.concept_set().save(tmp_path / "cc")
    rebuilt = multisite_from_concept_set(ConceptSet.load(tmp_path / "cc"))
    xs = chunks(1, seed=5)[0]
    assert torch.equal(rebuilt.encode(*xs), cc.encode(*xs))
    for a, b in zip(rebuilt.reconstruct(*xs), cc.reconstruct(*xs)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="not a multi-site set"):
        multisite_from_concept_set(ConceptSet(torch.eye(3), method="topk"))
