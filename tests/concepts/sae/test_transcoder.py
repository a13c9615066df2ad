"""Transcoders: planted sparse MLP features, bit-identical resume, merges, raw-space folding, SAELens files."""

import pytest
import torch

from conceptlens.concepts import ConceptSet
from conceptlens.concepts.sae.transcoder import SkipTranscoder, Transcoder
from conceptlens.concepts.sae.transcoder_io import export_transcoder, import_transcoder, transcoder_from_concept_set
from tests.conftest import roundtrip

D_IN, D_OUT, N_FEATURES, ACTIVE = 32, 24, 64, 3
SMALL = dict(width=16, batch_size=64, warmup_tokens=100, buffer_size=128, dead_after=200)
CLASSES = {"transcoder": Transcoder, "skip": SkipTranscoder}


def planted_mlp(n: int, seed: int = 0, linear: float = 0.0):
    """A synthetic MLP with known sparse features: token t holds ACTIVE of N_FEATURES features with
    coefficients f in [0.5, 1.5]; its input is f E + 1 and its output f D + 0.3 (+ `linear` times a
    dense linear map of the input, which only a skip path can carry)."""
    g = torch.Generator().manual_seed(seed)
    E = torch.nn.functional.normalize(torch.randn(N_FEATURES, D_IN, generator=g), dim=1)
    D = torch.nn.functional.normalize(torch.randn(N_FEATURES, D_OUT, generator=g), dim=1)
    chosen = torch.rand(n, N_FEATURES, generator=g).argsort(1)[:, :ACTIVE]
    f = torch.zeros(n, N_FEATURES).scatter(1, chosen, 0.5 + torch.rand(n, ACTIVE, generator=g))
    x = f @ E + 1.0
    M = torch.randn(D_IN, D_OUT, generator=g) / D_IN**0.5
    return x, f @ D + 0.3 + linear * x @ M, D


def recovered(atoms, directions, cos=0.9):
    unit = directions / directions.norm(dim=1, keepdim=True)
    return ((atoms @ unit.T).max(1).values > cos).float().mean().item()


def fvu(y, y_hat):
    return ((y - y_hat).pow(2).sum() / (y - y.mean(0)).pow(2).sum()).item()


def fit(tc, x, y, passes=1, chunk=1000):
    for _ in range(passes):
        for a, b in zip(x.split(chunk), y.split(chunk)):
            tc.update(a, b)
    return tc


def test_transcoder_recovers_planted_mlp_features():
    x, y, D = planted_mlp(55_000)
    tc = fit(Transcoder(width=96, batch_size=512, warmup_tokens=512, seed=0), x[:50_000], y[:50_000], passes=6)
    share = recovered(D, tc.concept_set().directions)
    held_out = fvu(y[50_000:], tc.reconstruct(x[50_000:]))
    print(f"transcoder: {share:.0%} of the planted output features recovered, held-out FVU {held_out:.3f}")
    assert share >= 0.9
    assert held_out < 0.35


def test_skip_transcoder_carries_the_dense_linear_part():
    x, y, D = planted_mlp(35_000, linear=1.0)
    kwargs = dict(width=96, batch_size=512, warmup_tokens=512, seed=0)
    plain = fit(Transcoder(**kwargs), x[:30_000], y[:30_000], passes=2)
    skip = fit(SkipTranscoder(**kwargs), x[:30_000], y[:30_000], passes=2)
    fvus = {name: fvu(y[30_000:], tc.reconstruct(x[30_000:])) for name, tc in (("plain", plain), ("skip", skip))}
    print(f"held-out FVU with a dense linear part: transcoder {fvus['plain']:.3f}, skip transcoder {fvus['skip']:.3f}")
    assert fvus["skip"] < fvus["plain"] - 0.05
    assert skip.params["W_skip"].detach().abs().sum() > 0


def pairs(n_chunks=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(20, 90, (n_chunks,), generator=g).tolist()
    xs = [3 + 5 * torch.randn(n, 10, generator=g).relu() for n in sizes]
    return [(x, (x[:, :6] * 2 - 1).relu() + 0.1 * torch.randn(len(x), 6, generator=g)) for x in xs]


def feed(tc, chunks):
    for x, y in chunks:
        tc.update(x, y)
    return tc



@pytest.mark.parametrize("name", CLASSES)
@pytest.mark.parametrize("cut", [1, 6])  # during warm-up, and after several steps
def test_resume_is_bit_identical(name, cut):
    chunks = pairs()
    full = feed(CLASSES[name](**SMALL), chunks)
    first = feed(CLASSES[name](**SMALL), chunks[:cut])
    resumed = CLASSES[name](**SMALL)
    resumed.load_state_dict(roundtrip(first.state_dict()))
    feed(resumed, chunks[cut:])
    assert full.stats().steps > 5
    assert full.params.keys() == resumed.params.keys()
    for key in full.params:
        assert torch.equal(full.params[key], resumed.params[key]), key
    assert full.stats() == resumed.stats()
    probe = pairs(1, seed=9)[0][0]
    assert torch.equal(full.reconstruct(probe), resumed.reconstruct(probe))


@pytest.mark.parametrize("name", CLASSES)
def test_merge_averages_replicas_and_pools_warm_ups(name):
    base = feed(CLASSES[name](**SMALL), pairs()[:4])
    a, b = CLASSES[name](**SMALL), CLASSES[name](**SMALL)
    a.load_state_dict(base.state_dict())
    b.load_state_dict(base.state_dict())
    feed(a, pairs(seed=1)[:5])
    feed(b, pairs(seed=2)[:5])
    expected = {k: (a.params[k] + b.params[k]).detach() / 2 for k in a.params}
    a.merge(b.state_dict())
    for key, value in expected.items():
        torch.testing.assert_close(a.params[key].detach(), value)
    # two replicas still warming up pool their per-side sums: the scales of one that saw both
    x, y = (torch.cat(t) for t in zip(*pairs()))
    one = feed(CLASSES[name](**SMALL), [(x[:60], y[:60]), (x[60:100], y[60:100])])  # warm-up: 100 rows
    c, d = feed(CLASSES[name](**SMALL), [(x[:60], y[:60])]), feed(CLASSES[name](**SMALL), [(x[60:100], y[60:100])])
    assert c.scale is None and d.scale is None
    c.merge(d)
    for key in ("scale_in", "scale_out"):
        torch.testing.assert_close(c.buffer_dict[key], one.buffer_dict[key])


@pytest.mark.parametrize("name", CLASSES)
def test_raw_space_fold_matches_the_training_space(name):
    tc = feed(CLASSES[name](**SMALL), pairs())
    with torch.no_grad():  # skip path trained away from zero, so the fold of W_skip is tested too
        for p in tc.params.values():
            p.add_(0.01)
    x = pairs(1, seed=5)[0][0]
    s_in, s_out = tc.buffer_dict["scale_in"], tc.buffer_dict["scale_out"]
    w = tc._weights()
    with torch.no_grad():
        z_n = (x * s_in @ w["W_enc"] + w["b_enc"]).relu()
        y_n = z_n @ w["W_dec"] + w["b_dec"] + (x * s_in @ w["W_skip"] if name == "skip" else 0)
    torch.testing.assert_close(tc.encode(x), z_n / s_in, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(tc.reconstruct(x), y_n / s_out, rtol=1e-4, atol=1e-4)
    cs = tc.concept_set()
    assert cs.directions.shape == (16, 6) and cs.config["d_in"] == 10 and cs.method == tc.method
    rebuilt = transcoder_from_concept_set(cs)
    torch.testing.assert_close(rebuilt.reconstruct(x), tc.reconstruct(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", CLASSES)
def test_saelens_reads_our_files_and_we_read_its_files(name, tmp_path):
    sae_lens = pytest.importorskip("sae_lens")
    tc = feed(CLASSES[name](**SMALL), pairs())
    with torch.no_grad():
        for p in tc.params.values():
            p.add_(0.01)
    x = pairs(1, seed=5)[0][0]
    export_transcoder(tc, tmp_path / "ours")
    theirs = sae_lens.SAE.load_from_disk(tmp_path / "ours")
    assert type(theirs).__name__ == ("SkipTranscoder" if name == "skip" else "Transcoder")
    with torch.no_grad():
        torch.testing.assert_close(theirs.encode(x), tc.encode(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(theirs(x), tc.reconstruct(x), rtol=1e-5, atol=1e-5)
    theirs.save_model(tmp_path / "theirs")  # a file SAELens wrote itself
    back = import_transcoder(tmp_path / "theirs")
    for key in ("W_enc", "b_enc", "b_dec"):
        assert torch.equal(back.encoder[key], tc.concept_set().encoder[key]), key
    assert torch.equal(back.directions, tc.concept_set().directions)
    with torch.no_grad():
        torch.testing.assert_close(transcoder_from_concept_set(back).reconstruct(x), theirs(x), rtol=1e-5, atol=1e-5)


def test_bad_input_is_named():
    tc = Transcoder(**SMALL)
    with pytest.raises(TypeError, match="x_in, x_out"):
        tc.update(torch.zeros(4, 10))
    with pytest.raises(ValueError, match="same tokens"):
        tc.update(torch.zeros(4, 10), torch.zeros(5, 6))
    tc.update(torch.ones(4, 10), torch.ones(4, 6))
    with pytest.raises(ValueError, match="input width 10"):
        tc.update(torch.ones(4, 9), torch.ones(4, 6))
    with pytest.raises(ValueError, match="not a transcoder"):
        transcoder_from_concept_set(ConceptSet(torch.eye(3), method="topk"))


def test_fit_feeds_a_transcoder_the_same_tokens_at_two_sites():
    import conceptlens
    from tests.conftest import CharTokenizer, tiny_model

    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    tc = Transcoder(width=8, batch_size=16, warmup_tokens=16, buffer_size=32)
    texts = [f"document {i} says {'abc' * (i % 4)} and more" for i in range(12)]
    report = lens.fit({("blocks.0.resid_in", "blocks.0.mlp_out"): tc}, texts, batch_size=4, max_length=16,
                      progress=False)
    cs = next(iter(report.concepts.values()))
    assert tc.stats().steps > 0 and tc.d_in == lens.site("blocks.0.resid_in").shape[-1]
    assert cs.directions.shape == (8, lens.site("blocks.0.mlp_out").shape[-1])
    assert cs.config["fit"]["target_site"] == "blocks.0.mlp_out"
    assert cs.site == "blocks.0.mlp_out" and cs.config["fit"]["source_site"] == "blocks.0.resid_in"  # where W_dec lives
