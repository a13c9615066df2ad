"""StreamingKMeans and Deleuzian on real SmolLM2 block-15 activations of BBC News articles."""

from __future__ import annotations

import pytest
import torch
from sklearn.cluster import MiniBatchKMeans

from conceptlens import data, models
from conceptlens.concepts.deleuzian import Deleuzian
from conceptlens.concepts.kmeans import StreamingKMeans


def effective_rank(c: torch.Tensor) -> float:
    s = torch.linalg.svdvals(c.double())
    q = s / s.sum()
    return float(torch.exp(-(q * q.clamp_min(1e-300).log()).sum()))


@pytest.fixture(scope="module")
def block15() -> torch.Tensor:
    """~1900 residual rows after block 15 of 30 articles (all topics), max 64 tokens each,
    with padding and each sequence's first position (an attention sink) dropped."""
    model, tok = models.load("smollm2-135m")
    texts = data.load("bbc-news", "all").texts[::74][:30]
    rows = []
    with torch.no_grad():
        for i in range(0, len(texts), 10):
            batch = tok(texts[i:i + 10], return_tensors="pt", padding=True, truncation=True, max_length=64)
            # base_model skips the LM head; hidden_states[0] is the embedding output.
            hidden = model.base_model(**batch, output_hidden_states=True).hidden_states[16]
            keep = batch["attention_mask"].bool()
            keep[torch.arange(len(keep)), keep.int().argmax(1)] = False  # first real token, either padding side
            rows.append(hidden[keep])
    return torch.cat(rows)


@pytest.mark.real_model
@pytest.mark.parametrize("seed", [0, 1])
def test_streaming_kmeans_matches_minibatch_kmeans_at_equal_passes(block15, seed):
    x, passes, gen = block15, 3, torch.Generator().manual_seed(seed)
    km = StreamingKMeans(32, batch_size=256, seed=seed)
    for _ in range(passes):
        km.update(x[torch.randperm(len(x), generator=gen)])
    ref = MiniBatchKMeans(32, batch_size=256, max_iter=passes, n_init=1, random_state=seed,
                          max_no_improvement=None, tol=0.0).fit(x.numpy())
    ref_inertia = float(((x - torch.from_numpy(ref.cluster_centers_)[ref.predict(x.numpy())]) ** 2).sum())
    assert km.inertia(x) <= 1.02 * ref_inertia, km.inertia(x) / ref_inertia


@pytest.mark.real_model
@pytest.mark.parametrize("seed", [0, 1])
def test_skew_weighting_raises_effective_rank_of_deleuzian_concepts(block15, seed):
    def fit(skew_weighting: bool) -> torch.Tensor:
        dz = Deleuzian(32, reference_size=1024, buffer_size=512, batch_size=256, skew_weighting=skew_weighting,
                       seed=seed)
        for chunk in block15.split(500):
            dz.update(chunk)
        return dz.centroids

    weighted, plain = effective_rank(fit(True)), effective_rank(fit(False))
    assert weighted > 1.03 * plain, (weighted, plain)
