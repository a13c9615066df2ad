"""The shared extractor base: validation, config checks, merge dispatch, stats(), device placement."""

import pytest
import torch

from conceptlens.concepts import (BatchTopKSAE, CLVQTranscoder, Deleuzian, JumpReLUSAE, MatryoshkaSAE, ReLUSAE,
                                  SpaDE, StreamingKMeans, TopKSAE, VQCodebook)
from conceptlens._checks import check_fraction, check_int
from conceptlens.concepts.base import ExtractorBase
from conceptlens.metrics.gauge import QueryKeyMoments
from conceptlens.metrics.hierarchy import CoactivationStats
from tests.concepts.test_protocol import DICTIONARIES, EXTRACTORS, fitted, roundtrip, stream
from tests.conftest import assert_same_state

_SAE = dict(batch_size=64, warmup_tokens=64, seed=1)
EVERY = [
    lambda: StreamingKMeans(4, seed=1), lambda: Deleuzian(4, reference_size=64, buffer_size=128, batch_size=64),
    lambda: ReLUSAE(width=8, **_SAE), lambda: TopKSAE(width=8, k=2, **_SAE), lambda: BatchTopKSAE(width=8, k=2, **_SAE),
    lambda: JumpReLUSAE(width=8, **_SAE), lambda: SpaDE(width=8, **_SAE),
    lambda: MatryoshkaSAE(width=8, k=2, prefixes=(4, 8), **_SAE),
    lambda: VQCodebook(4, init_size=64), lambda: CLVQTranscoder(4, hidden=8, batch_size=64, codebook={"init_size": 64}),
    lambda: QueryKeyMoments(), lambda: CoactivationStats(width=6, top=2),
]


def _feed(ext, n=400, d=6):
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(0))
    if isinstance(ext, CLVQTranscoder):
        ext.update(x, 2 * x)
    elif isinstance(ext, QueryKeyMoments):
        ext.update(x.reshape(n, 2, 3), x.reshape(n, 2, 3))
    else:
        ext.update(x.relu() if isinstance(ext, CoactivationStats) else x)
    return ext


@pytest.mark.parametrize("make", EVERY)
def test_every_extractor_shares_the_base(make):
    ext = make()
    assert isinstance(ext, ExtractorBase)
    report = _feed(ext).stats()  # a method on every extractor, returning a NamedTuple
    assert isinstance(report, tuple) and hasattr(report, "_asdict")
    state = roundtrip(ext.state_dict())
    twin = type(ext).from_state(state)  # the config travels with the state
    assert_same_state(twin.state_dict(), ext.state_dict())
    merged = make()
    merged.merge(state)  # a state dict merges like the object it came from
    other = make()
    other.merge(ext)
    assert_same_state(merged.state_dict(), other.state_dict())


@pytest.mark.parametrize("make", [
    lambda: StreamingKMeans(True), lambda: StreamingKMeans(4, batch_size=True), lambda: Deleuzian(True),
    lambda: VQCodebook(4, top_k=False), lambda: TopKSAE(width=True, k=1), lambda: CLVQTranscoder(True),
    lambda: CoactivationStats(width=True), lambda: QueryKeyMoments(n_kv_heads=False),
    lambda: StreamingKMeans(4, spherical="yes"), lambda: VQCodebook(4, decay=1.0), lambda: TopKSAE(width=4, k=1, seed=-1),
])
def test_bools_and_bad_values_are_rejected_by_name(make):
    with pytest.raises(ValueError, match="must be"):
        make()


def test_helpers_name_the_value():
    with pytest.raises(ValueError, match=r"n must be a positive integer or None; got True"):
        check_int("n", True, optional=True)
    with pytest.raises(ValueError, match=r"p must be a number in \[0, 1\]; got 1.5"):
        check_fraction("p", 1.5, closed_high=True)


@pytest.mark.parametrize("factory", EXTRACTORS + DICTIONARIES)
def test_state_of_another_config_is_refused_with_the_difference(factory):
    ext = fitted(factory, stream(n_chunks=2))
    state = ext.state_dict()
    held = state["_extra_state"] if "_extra_state" in state else state  # (an SAE keeps it beside its tensors)
    held["config"] = {**held["config"], "seed": 99} if "seed" in held["config"] else {**held["config"], "k": 1}
    with pytest.raises(ValueError, match="different config"):
        factory().load_state_dict(state)


def test_merge_refuses_another_class():
    with pytest.raises(TypeError, match="can only merge a StreamingKMeans"):
        StreamingKMeans(4).merge(VQCodebook(4))


@pytest.mark.parametrize("make", EVERY)
def test_device_placement(make):
    ext = make()
    ext._set_device("cpu")
    _feed(ext)
    moved = ext.to("cpu")  # a round trip through the state, tensors mapped
    assert moved is ext and ext.device == torch.device("cpu")
    state = ext.state_dict()
    tensors = [v for v in _tensors(state) if v.dtype != torch.uint8]
    assert tensors and all(t.device.type == "cpu" for t in tensors)


def test_device_keyword_is_not_part_of_the_config():
    a, b = StreamingKMeans(4, device="cpu"), StreamingKMeans(4)
    assert a.config_dict() == b.config_dict() and a.device == torch.device("cpu") and b.device is None
    b.load_state_dict(fitted(lambda: StreamingKMeans(4, device="cpu"), stream(n_chunks=2)).state_dict())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_device_moves_inputs_and_state_to_the_gpu():
    km = StreamingKMeans(4, device="cuda")
    for x in stream(n_chunks=4):
        km.update(x)  # CPU inputs
    assert km.centres.device.type == "cuda" and km.encode(torch.randn(3, 6)).device.type == "cuda"
    sae = TopKSAE(width=8, k=2, **_SAE, device="cuda")
    _feed(sae)
    assert sae.params["W_dec"].device.type == "cuda"
    assert sae.to("cpu").params["W_dec"].device.type == "cpu"


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


@pytest.mark.parametrize("sizes", [(1, 299), (150, 150), (37, 200, 63)])  # uneven shards, 2 or 3 workers
def test_statistics_merged_from_disjoint_shards_equal_one_pass(sizes):
    g = torch.Generator().manual_seed(2)
    q, k, z = torch.randn(300, 4, 3, generator=g), torch.randn(300, 2, 3, generator=g), torch.randn(300, 9, generator=g)
    whole_m, whole_c = QueryKeyMoments(), CoactivationStats(width=9, top=3)
    whole_m.update(q, k)
    whole_c.update(z)
    merged_m, merged_c = QueryKeyMoments(), CoactivationStats(width=9, top=3)
    for part in torch.arange(300).split(list(sizes)):
        m, c = QueryKeyMoments(), CoactivationStats(width=9, top=3)
        m.update(q[part], k[part])
        c.update(z[part])
        merged_m.merge(roundtrip(m.state_dict()))  # as a reduced state dict would arrive
        merged_c.merge(c)
    for name in ("sum_qq", "sum_kk", "sum_q", "sum_k"):
        torch.testing.assert_close(getattr(merged_m, name), getattr(whole_m, name), rtol=1e-12, atol=1e-12)
    assert (merged_m.n_q, merged_m.n_k) == (300, 300) and merged_c.n == 300
    for name in ("count", "mass", "co_mass", "co_count"):
        torch.testing.assert_close(getattr(merged_c, name), getattr(whole_c, name), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sizes", [(0, 300), (1, 299), (120, 180)])
def test_kmeans_step_statistics_of_shards_add_up_to_the_batch(sizes):
    from conceptlens.concepts.kmeans import apply_step, squared_distances, step_statistics

    g = torch.Generator().manual_seed(4)
    x, centres = torch.randn(300, 5, generator=g), torch.randn(6, 5, generator=g)
    mass = torch.rand(6, dtype=torch.float64, generator=g) * 10
    w = torch.rand(300, generator=g)
    labels = squared_distances(x, centres).argmin(1)
    whole = apply_step(centres, mass, *step_statistics(centres, mass, x, w, labels))
    parts = [step_statistics(centres, mass, x[i], w[i], labels[i]) for i in torch.arange(300).split(list(sizes))]
    summed = apply_step(centres, mass, sum(p[0] for p in parts), sum(p[1] for p in parts))
    for a, b in zip(summed, whole):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
