"""The fast k-means kernels against the plain formulas, and batched seeding against sklearn."""

from __future__ import annotations

import pytest
import torch

from conceptlens.concepts import kmeans_math
from conceptlens.concepts.kmeans import StreamingKMeans, squared_distances
from conceptlens.concepts.kmeans_math import batched_seeds, nearest


@pytest.mark.parametrize("block", [1 << 22, 64])  # one chunk, and many chunks of rows
def test_nearest_matches_the_full_distance_matrix(monkeypatch, block):
    monkeypatch.setattr(kmeans_math, "_BLOCK", block)
    g = torch.Generator().manual_seed(0)
    x, c = torch.randn(300, 16, generator=g), torch.randn(40, 16, generator=g)
    labels, best = nearest(x, c)
    d2 = squared_distances(x, c)
    assert torch.equal(labels, d2.argmin(1))
    torch.testing.assert_close(best, d2.min(1).values, rtol=1e-5, atol=1e-4)


def blobs(k: int, per: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    centres = 50 * torch.randn(k, 8, generator=g)
    labels = torch.arange(k).repeat_interleave(per)
    return centres[labels] + torch.randn(k * per, 8, generator=g), labels


def test_batched_seeds_one_per_round_hits_every_separated_blob():
    x, labels = blobs(8, 40)
    idx = batched_seeds(x, 8, torch.Generator().manual_seed(1), rounds=8)
    assert idx.shape == (8,) and idx.unique().numel() == 8
    assert labels[idx].unique().numel() == 8  # D^2 sampling never picks a covered blob twice here


def test_batched_seeds_many_per_round_are_distinct_rows_and_respect_weights():
    x, labels = blobs(4, 50)
    weight = (labels != 3).float()  # blob 3 has no weight: never a seed
    idx = batched_seeds(x, 40, torch.Generator().manual_seed(0), weight, rounds=4)
    assert idx.unique().numel() == 40 and not (labels[idx] == 3).any()
    with pytest.raises(ValueError, match="at least k=300"):
        batched_seeds(x, 300, torch.Generator())


def test_batched_init_reaches_sklearn_inertia_on_unstructured_rows():
    """On rows without well-separated clusters (like residual activations) batched seeding and
    one mini-batch pass reach MiniBatchKMeans's inertia. (On separated blobs the greedy
    k-means++ trials matter: that is why "auto" keeps k-means++ up to k = 256.)"""
    from sklearn.cluster import MiniBatchKMeans

    x = torch.randn(4096, 16, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.2, 3, 16)
    km = StreamingKMeans(n_concepts=64, batch_size=512, init="batched", seed=0)
    for part in x.split(512):
        km.update(part)
    km.flush()
    sk = MiniBatchKMeans(n_clusters=64, batch_size=512, n_init=1, max_iter=1, random_state=0).fit(x.numpy())
    assert km.config.batched_init and km.inertia(x) <= 1.02 * sk.inertia_


def test_init_choice_is_checked():
    with pytest.raises(ValueError, match="init must be one of"):
        StreamingKMeans(n_concepts=4, init="kmeans||")
    assert not StreamingKMeans(n_concepts=256).config.batched_init
    assert StreamingKMeans(n_concepts=257).config.batched_init
