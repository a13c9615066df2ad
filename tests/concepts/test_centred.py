"""ConceptSets carry the fit's mean activation; `centred()` takes it out (planted mean, planted offsets)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conceptlens import ConceptSet
from conceptlens.concepts.deleuzian import Deleuzian
from conceptlens.concepts.kmeans import StreamingKMeans
from conceptlens.concepts.vq import VQCodebook


def planted(n: int = 6000, d: int = 24, k: int = 4, seed: int = 0):
    """Rows = a large mean + one of k orthogonal offsets (norm 4) + small noise."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(d, k + 1, generator=g)).Q.T  # (k + 1, d) orthonormal
    mean, offsets = 40.0 * basis[0], 4.0 * basis[1:]
    labels = torch.randint(k, (n,), generator=g)
    x = mean + offsets[labels] + 0.3 * torch.randn(n, d, generator=g)
    return x, mean, offsets


def best_cosines(directions, reference):
    """For each reference row, the largest cosine with any direction."""
    return (F.normalize(reference, dim=1) @ F.normalize(directions, dim=1).T).max(1).values


def test_kmeans_centred_centroids_are_the_planted_offsets_raw_ones_are_the_mean():
    x, mean, offsets = planted()
    km = StreamingKMeans(n_concepts=4, batch_size=500, seed=0)
    for chunk in x.split(500):
        km.update(chunk)
    cs = km.concept_set()
    torch.testing.assert_close(cs.mean, x.mean(0), atol=1e-3, rtol=0)  # exact up to float32 running means
    raw_cos_with_mean = F.normalize(cs.directions, dim=1) @ F.normalize(mean, dim=0)
    assert raw_cos_with_mean.min() > 0.99  # the raw centroids point along the mean
    assert best_cosines(cs.directions, offsets).max() < 0.2
    # centred: the planted offsets, measured from their own (nearly uniform) mean
    assert best_cosines(cs.centred().directions, offsets - offsets.mean(0)).min() > 0.99


def test_vq_and_deleuzian_record_the_mean_and_centre_by_their_kind():
    x, mean, _ = planted(n=4096)
    vq = VQCodebook(n_codes=4, seed=0)
    dz = Deleuzian(n_concepts=4, batch_size=512, buffer_size=1024, seed=0)
    for chunk in x.split(512):
        vq.update(chunk)
        dz.update(chunk)
    vq.flush()
    dz.flush()
    for cs in (vq.concept_set(), dz.concept_set()):
        assert F.cosine_similarity(cs.mean, x.mean(0), dim=0) > 0.999
        assert (cs.mean.norm() - x.mean(0).norm()).abs() < 0.05 * x.mean(0).norm()
    # Deleuzian directions are differences: centring removes their component along the mean
    centred = dz.concept_set().centred()
    assert (centred.directions @ centred.mean).abs().max() < 1e-3 * centred.directions.norm(dim=1).max() * 40


def test_mean_survives_indexing_saving_and_centring_once(tmp_path):
    g = torch.Generator().manual_seed(1)
    cs = ConceptSet(torch.randn(5, 8, generator=g), site="blocks.0.resid_out", method="kmeans",
                    mean=torch.randn(8, generator=g))
    loaded = ConceptSet.load(cs.save(tmp_path / "cs"))
    assert torch.equal(loaded.mean, cs.mean) and torch.equal(cs[[1, 3]].mean, cs.mean)
    torch.testing.assert_close(cs.centred()[[1, 3]].directions, cs[[1, 3]].directions - cs.mean)
    assert cs.centred().centred() is not cs and torch.equal(cs.centred().centred().directions,
                                                            cs.centred().directions)
    assert ConceptSet.load(cs.centred().save(tmp_path / "c")).config["centred"] is True
    with pytest.raises(ValueError, match="carries no mean"):
        ConceptSet(torch.randn(2, 8)).centred()
    for method in ("topk", "jumprelu"):  # an SAE set says what to do instead
        with pytest.raises(ValueError, match=r"is an SAE's: its decoder rows are directions already.*as it is$"):
            ConceptSet(torch.randn(2, 8), method=method).centred()
    with pytest.raises(ValueError, match=r"mean has shape \(7,\)"):
        ConceptSet(torch.randn(2, 8), mean=torch.zeros(7))
