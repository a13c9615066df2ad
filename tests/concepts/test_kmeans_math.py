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


def test_bf16_distances_to_a_centre_do_not_depend_on_the_other_centres_passed():
    """A sharded fit takes the nearest over each shard's nearest: in bfloat16 each centre's distance must
    not change with the shard it is in (the shift that keeps the product's rounding small is the rows')."""
    g = torch.Generator().manual_seed(0)
    c = torch.randn(32, 32, generator=g)
    c[:, 0] += 40  # a large common mean, as a residual stream has
    x = (c[torch.randint(0, 32, (4000,), generator=g)] + 0.3 * torch.randn(4000, 32, generator=g)).bfloat16()
    c = c.bfloat16()
    labels, best = nearest(x, c)
    (la, ba), (lb, bb) = nearest(x, c[:16]), nearest(x, c[16:])
    first = ba <= bb  # the lowest index on a tie, as one argmin
    assert torch.equal(torch.where(first, la, lb + 16), labels) and torch.equal(torch.where(first, ba, bb), best)
    assert torch.equal(torch.cat([squared_distances(x, c[:16]), squared_distances(x, c[16:])], 1),
                       squared_distances(x, c))


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


def plain_kmeans_plusplus(x, k, generator, w):
    """Greedy k-means++ by its definition (the form this module had before its fast kernels)."""
    trials, d2_all = 2 + int(torch.log(torch.tensor(float(k)))), torch.cdist(x.double(), x.double()) ** 2
    chosen = [int(torch.multinomial(w, 1, replacement=True, generator=generator))]
    closest = d2_all[chosen[0]]
    for _ in range(1, k):
        cand = torch.multinomial(w * closest, trials, replacement=True, generator=generator)
        d2 = torch.minimum(closest[None], d2_all[cand])  # (trials, N)
        best = int((d2 * w).sum(1).argmin())
        chosen.append(int(cand[best]))
        closest = d2[best]
    return torch.tensor(chosen)


def plain_lloyd(x, w, k, generator):
    """Weighted Lloyd from the k-means++ seeds until an assignment repeats; labels of the final centres."""
    centres, labels = x[plain_kmeans_plusplus(x, k, generator, w)], None
    while True:
        new = torch.cdist(x.double(), centres.double()).argmin(1)
        if labels is not None and torch.equal(new, labels):
            return centres, new
        labels = new
        mass = torch.zeros(k, dtype=torch.float64).index_add_(0, labels, w)
        sums = torch.zeros(k, x.shape[1], dtype=torch.float64).index_add_(0, labels, x.double() * w[:, None])
        centres = torch.where(mass[:, None] > 0, sums / mass.clamp_min(1e-300)[:, None], centres.double()).float()


@pytest.mark.parametrize("block", [1 << 22, 64])  # one chunk of rows per assignment, and many
def test_kmeans_plusplus_and_lloyd_match_the_plain_definitions(monkeypatch, block):
    """The fast kernels give the seeds, centres and labels of the definitions, whatever their summation
    order: seeds on small integers (every distance exact, ties included), Lloyd on tight integer blobs far
    apart (one seed each, every assignment by a wide margin, centres exact means of 32 rows)."""
    from conceptlens.concepts.vq_math import initial_codes

    monkeypatch.setattr(kmeans_math, "_BLOCK", block)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-4, 5, (256, 6), generator=g).float() * 8
    w = torch.randint(1, 4, (256,), generator=g).double()
    seeds = kmeans_math.kmeans_plusplus(x, 12, torch.Generator().manual_seed(3), w)
    assert torch.equal(seeds, plain_kmeans_plusplus(x, 12, torch.Generator().manual_seed(3), w))
    blob = torch.randint(-20, 21, (8, 6), generator=g).float() * 64  # 8 blob centres >= 64 apart
    x = blob.repeat_interleave(32, 0) + torch.randint(-2, 3, (256, 6), generator=g).float()
    centres, labels = initial_codes(x, 8, "kmeans", torch.Generator().manual_seed(5))
    ref_centres, ref_labels = plain_lloyd(x, torch.ones(256, dtype=torch.float64), 8, torch.Generator().manual_seed(5))
    assert torch.equal(labels, ref_labels)
    assert torch.equal(centres, ref_centres)
