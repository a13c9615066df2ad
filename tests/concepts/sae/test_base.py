"""The Extractor protocol for every SAE variant: resume, raw-space export, merge, errors."""

import copy

import pytest
import torch

from conceptlens.concepts import ConceptSet, Extractor
from conceptlens.concepts.sae import (ActMSAE, BatchTopKSAE, EWGSAE, JumpReLUSAE, MatryoshkaSAE, ReLUSAE, SpaDE,
                                      TopKSAE, sae_from_concept_set)

from tests.conftest import roundtrip

SMALL = dict(width=24, batch_size=64, warmup_tokens=100, buffer_size=128, dead_after=200)
VARIANTS = {
    "relu": lambda seed=0: ReLUSAE(**SMALL, l1=0.5, seed=seed),
    "topk": lambda seed=0: TopKSAE(**SMALL, k=4, seed=seed),
    "batchtopk": lambda seed=0: BatchTopKSAE(**SMALL, k=4, seed=seed),
    "jumprelu": lambda seed=0: JumpReLUSAE(**SMALL, l0=0.1, threshold_init=0.1, bandwidth=0.05, seed=seed),
    "spade": lambda seed=0: SpaDE(**SMALL, seed=seed),
    "matryoshka": lambda seed=0: MatryoshkaSAE(**SMALL, k=4, prefixes=(6, 12, 24), seed=seed),
    "actmsae": lambda seed=0: ActMSAE(**SMALL, k=2, ks=(2, 6, 24), seed=seed),
    "ewg": lambda seed=0: EWGSAE(**SMALL, groups=(3, 9, 24), l1=0.3, seed=seed),
}
pytestmark = pytest.mark.parametrize("name", VARIANTS)


def stream(n_chunks: int = 12, d: int = 10, seed: int = 0) -> list[torch.Tensor]:
    """Chunks of uneven sizes (so batches straddle them), mean and scale far from 0 and 1."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(20, 90, (n_chunks,), generator=g).tolist()
    return [3 + 5 * torch.randn(n, d, generator=g).relu() for n in sizes]


def feed(sae, chunks):
    for x in chunks:
        sae.update(x)
    return sae



def assert_same(a, b):
    assert a.params.keys() == b.params.keys() and a.params
    for key in a.params:
        assert torch.equal(a.params[key], b.params[key]), key
    for key in a.buffer_dict:
        assert torch.equal(a.buffer_dict[key], b.buffer_dict[key]), key
    for pa, pb in zip(a.params.values(), b.params.values()):
        for key, value in a.trainer.optimizer.state[pa].items():
            assert torch.equal(value, b.trainer.optimizer.state[pb][key]), key
    assert a.stats() == b.stats()
    x = stream(1, seed=9)[0]
    assert torch.equal(a.encode(x), b.encode(x))


@pytest.mark.parametrize("cut", [1, 6])  # during warm-up, and after several steps
def test_resume_is_bit_identical(name, cut):
    chunks = stream()
    full = feed(VARIANTS[name](), chunks)
    first = feed(VARIANTS[name](), chunks[:cut])
    state = roundtrip(first.state_dict())
    resumed = VARIANTS[name]()
    resumed.load_state_dict(state)
    feed(resumed, chunks[cut:])
    feed(first, chunks[cut:])  # the original keeps going too: state_dict shares nothing with it
    assert full.stats().steps > 5
    assert_same(full, resumed)
    assert_same(full, first)


def test_concept_set_and_encode_work_on_raw_activations(name):
    sae = feed(VARIANTS[name](), stream())
    assert isinstance(sae, Extractor)
    x = stream(1, seed=5)[0]
    # the same code computed in the normalised training space, mapped back by hand
    with torch.no_grad():
        w = sae._weights()
        if name == "spade":  # standardised per feature: x_n = (x - mu) / sigma
            mean, std = sae.buffer_dict["input_mean"], sae.buffer_dict["input_std"]
            code = sae._encode((x - mean) / std, w, train=False).z
            x_hat = sae._decode(code, w) * std + mean
        else:
            code = sae._encode(x * sae.scale, w, train=False).z
            x_hat = sae._decode(code, w) / sae.scale
    z = sae.encode(x)
    expected_z = code if name == "spade" else code / sae.scale  # simplex codes carry no units
    torch.testing.assert_close(z, expected_z, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sae.decode(z), x_hat, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sae.reconstruct(x), x_hat, rtol=1e-4, atol=1e-4)
    cs = sae.concept_set()
    assert isinstance(cs, ConceptSet) and cs.site is None and cs.method == sae.method
    assert cs.directions.shape == (24, 10) and cs.config["width"] == 24
    torch.testing.assert_close(cs.stats["firing_frequency"], sae.trainer.tracker.frequency())
    if name != "spade":
        if name != "relu":  # the April 2024 ReLU SAE keeps free decoder norms
            torch.testing.assert_close(cs.directions.norm(dim=1), torch.ones(24))
        assert {"W_enc", "b_enc", "b_dec"} <= cs.encoder.keys()
        assert ("threshold" in cs.encoder) == (name in ("jumprelu", "batchtopk"))


def test_rebuilt_from_concept_set_encodes_alike(name, tmp_path):
    sae = feed(VARIANTS[name](), stream())
    sae.concept_set().save(tmp_path)
    rebuilt = sae_from_concept_set(ConceptSet.load(tmp_path))
    x = stream(1, seed=5)[0]
    torch.testing.assert_close(rebuilt.encode(x), sae.encode(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rebuilt.reconstruct(x), sae.reconstruct(x), rtol=1e-5, atol=1e-4)
    feed(rebuilt, stream(6, seed=6))  # and it can keep training
    assert rebuilt.stats().steps > 0


def test_stats_and_flush(name):
    sae = VARIANTS[name]()
    sae.update(torch.cat(stream())[:50])  # less than the warm-up: nothing trained yet
    with pytest.raises(RuntimeError, match="not taken a step"):
        sae.encode(torch.zeros(2, 10))
    assert sae.stats().steps == 0 and sae.stats().last is None
    sae.flush()  # end of a short stream: the scale comes from what was seen, one short batch
    assert sae.stats().steps == 1 and sae.stats().tokens == 50
    sae = feed(VARIANTS[name](), stream())
    last = sae.stats().last
    assert 0 <= last.fvu and 0 <= last.dead_fraction <= 1 and 0 < last.l0 <= 24
    assert sae.trainer.mixer.count > 0
    sae.flush()
    assert sae.stats().tokens == sum(len(c) for c in stream())  # every row trained on, once
    assert sae.trainer.mixer.count == 0


def test_merge_averages_replicas(name):
    base = feed(VARIANTS[name](), stream()[:4])
    state = base.state_dict()
    a, b = VARIANTS[name](), VARIANTS[name]()
    a.load_state_dict(state)
    b.load_state_dict(state)
    feed(a, stream(seed=1)[:5])
    feed(b, stream(seed=2)[:5])
    expected = {k: (a.params[k] + b.params[k]).detach() / 2 for k in a.params}
    a.merge(b)
    for key, value in expected.items():
        if key == "W_dec" and a.unit_decoder:
            value = value / value.norm(dim=1, keepdim=True)
        torch.testing.assert_close(a.params[key].detach(), value)
    other = feed(VARIANTS[name](seed=1), stream(seed=3))  # its own warm-up: another scale
    with pytest.raises(ValueError, match="scale"):
        a.merge(other)


def test_rejects_bad_input_and_state(name):
    sae = feed(VARIANTS[name](), stream()[:3])
    with pytest.raises(ValueError, match="width d=10"):
        sae.update(torch.zeros(5, 11))
    with pytest.raises(ValueError, match="float tensor"):
        sae.update(torch.zeros(5))
    other = TopKSAE(**SMALL, k=5)  # another class, or another config
    with pytest.raises(ValueError, match="config|state is for"):
        other.load_state_dict(sae.state_dict())


def test_merge_keeps_each_buffered_row_once_in_either_order(name):
    """Each replica's buffered rows are in the merged buffer once (its own were added a second time),
    and a replica still warming up merges into a trained one as the reverse merge does."""
    base = feed(VARIANTS[name](), stream()[:4])
    a, b = VARIANTS[name](), VARIANTS[name]()
    a.load_state_dict(base.state_dict())
    b.load_state_dict(base.state_dict())
    feed(a, stream(seed=1)[:3])
    feed(b, stream(seed=2)[:2])
    held = a.trainer.mixer.count + b.trainer.mixer.count
    a.merge(b)
    assert a.trainer.mixer.count == held
    warming = VARIANTS[name]()
    warming.update(stream(seed=4)[0][:7])  # fewer rows than the warm-up takes
    assert warming.scale is None
    trained, twin = copy.deepcopy(a), copy.deepcopy(warming)
    trained.merge(warming)  # it refused a replica still warming up
    twin.merge(a)  # the reverse: it takes the trained state, then adds its own rows
    assert trained.trainer.mixer.count == twin.trainer.mixer.count == a.trainer.mixer.count + 7
    assert sorted(trained.trainer.mixer.state_dict()["data"].sum(1).tolist()) == \
        sorted(twin.trainer.mixer.state_dict()["data"].sum(1).tolist())
    assert all(torch.equal(trained.params[k], twin.params[k]) for k in trained.params)


def test_rounds_of_local_sgd_count_the_shared_start_once(name):
    """Replicas of a state marked as their shared start both carry its history: a merge counts its
    tokens and firing counts once, round after round (they were added again at every merge)."""
    a = feed(VARIANTS[name](), stream()[:4])
    a.flush()
    trained = a.stats().tokens
    for round_ in range(3):
        a.mark_shared_start()
        start = a.trainer.tracker.fired.clone()
        b = VARIANTS[name]()
        b.load_state_dict(a.state_dict())
        feed(a, stream(seed=10 + round_)[:2])
        feed(b, stream(seed=20 + round_)[:3])
        a.flush()
        b.flush()
        fired = a.trainer.tracker.fired + b.trainer.tracker.fired - start
        shared = a.trainer.running.origin  # the tokens of the start, which both replicas report
        trained += (a.stats().tokens - shared) + (b.stats().tokens - shared)
        a.merge(b)
        assert a.stats().tokens == trained and torch.equal(a.trainer.tracker.fired, fired)
        assert a.trainer.tracker.tokens == trained
