"""Every extractor through the same protocol tests.

Add an extractor by appending a `pytest.param(factory, id=...)` to EXTRACTORS; the factory
builds a fresh object from nothing (same arguments every call), sized for a few thousand
rows of width <= 12.
"""

import json

import pytest
import torch

from conceptlens.concepts.base import Extractor
from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.concepts.deleuzian import Deleuzian
from conceptlens.concepts.kmeans import StreamingKMeans
from conceptlens.concepts.sae import BatchTopKSAE, JumpReLUSAE, MatryoshkaSAE, ReLUSAE, SpaDE, TopKSAE
from conceptlens.concepts.vq import VQCodebook
from tests.conftest import assert_same_state, roundtrip

EXTRACTORS = [
    pytest.param(lambda: StreamingKMeans(6, batch_size=128, init_size=500, reseed_after=1.0, seed=3), id="kmeans"),
    pytest.param(lambda: StreamingKMeans(6, spherical=True, seed=3), id="kmeans-spherical"),
    pytest.param(lambda: Deleuzian(5, reference_size=256, buffer_size=512, batch_size=128, seed=3), id="deleuzian"),
    pytest.param(lambda: Deleuzian(5, reference_size=256, buffer_size=512, batch_size=128, skew_weighting=False,
                                   seed=3), id="deleuzian-unweighted"),
]

# Dictionaries trained by gradient or EMA steps: same protocol, but their merge has its own
# contract (replicas of one initial state), tested with each of them.
_SAE = dict(batch_size=256, warmup_tokens=256, seed=3)
DICTIONARIES = [
    pytest.param(lambda: ReLUSAE(width=12, **_SAE), id="relu-sae"),
    pytest.param(lambda: TopKSAE(width=12, k=3, **_SAE), id="topk-sae"),
    pytest.param(lambda: BatchTopKSAE(width=12, k=3, **_SAE), id="batchtopk-sae"),
    pytest.param(lambda: JumpReLUSAE(width=12, **_SAE), id="jumprelu-sae"),
    pytest.param(lambda: SpaDE(width=12, **_SAE), id="spade"),
    pytest.param(lambda: MatryoshkaSAE(width=12, k=3, prefixes=(4, 12), **_SAE), id="matryoshka-sae"),
    pytest.param(lambda: VQCodebook(8, init_size=256, batch_size=128, seed=3), id="vq"),
]


def stream(n_chunks=8, rows=300, d=6, seed=0):
    """Chunks `(rows, d)` from a sparse mixture of a few directions, as a list."""
    g = torch.Generator().manual_seed(seed)
    dirs = 3 * torch.randn(4, d, generator=g)
    x = (torch.rand(n_chunks * rows, 4, generator=g) < 0.2).float() @ dirs + 0.3 * torch.randn(n_chunks * rows, d, generator=g)
    return list(x.split(rows))


def fitted(factory, chunks):
    ext = factory()
    for x in chunks:
        ext.update(x)
    return ext



@pytest.mark.parametrize("factory", EXTRACTORS + DICTIONARIES)
def test_follows_the_protocol_at_any_width(factory):
    for d in (5, 9):
        ext = fitted(factory, stream(d=d))
        assert isinstance(ext, Extractor)
        cs = ext.concept_set()
        n = len(cs)
        assert isinstance(cs, ConceptSet) and cs.directions.shape == (n, d) and cs.d == d
        assert cs.site is None and isinstance(cs.method, str) and cs.method != "custom"
        json.dumps(cs.config)
        assert all(v.shape[0] == n for v in cs.stats.values())
        assert ext.encode(torch.randn(7, d)).shape == (7, n)
        with pytest.raises(ValueError, match=str(d)):
            ext.update(torch.randn(3, d + 1))


@pytest.mark.parametrize("split", [1, 6])  # early (still initialising for some) and late
@pytest.mark.parametrize("factory", EXTRACTORS + DICTIONARIES)
def test_resume_from_state_dict_is_bit_identical(factory, split):
    chunks = stream()
    whole = fitted(factory, chunks)
    first = fitted(factory, chunks[:split])
    resumed = factory()
    resumed.load_state_dict(roundtrip(first.state_dict()))
    for x in chunks[split:]:
        resumed.update(x)
    probe = torch.randn(11, 6)
    assert torch.equal(resumed.concept_set().directions, whole.concept_set().directions)
    assert torch.equal(resumed.encode(probe), whole.encode(probe))
    assert_same_state(resumed.state_dict(), whole.state_dict())  # everything, not only the outputs



@pytest.mark.parametrize("factory", EXTRACTORS)
def test_merge(factory, tmp_path):
    chunks = stream()
    a = fitted(factory, chunks[:4])
    b = fitted(factory, chunks[4:])
    alone = a.concept_set().directions
    a.merge(factory())  # an empty extractor adds nothing
    assert torch.equal(a.concept_set().directions, alone)
    twin = fitted(factory, chunks[:4])
    twin.merge(roundtrip(b.state_dict()))
    a.merge(b)
    cs = a.concept_set()
    assert cs.directions.shape == alone.shape and torch.isfinite(cs.directions).all()
    assert torch.equal(cs.directions, twin.concept_set().directions)
    cs.save(tmp_path / "cs")
    assert torch.equal(ConceptSet.load(tmp_path / "cs").directions, cs.directions)
