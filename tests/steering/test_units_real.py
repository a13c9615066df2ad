"""The site-norm unit on SmolLM2: the probe text's median token norm is that of real documents."""

from __future__ import annotations

import pytest
import torch

import conceptlens
from conceptlens import data, models
from conceptlens.batching import encode_batch
from conceptlens.steering import Add, site_norm


@pytest.mark.real_model
@pytest.mark.parametrize("site", ["blocks.5.resid_out", "blocks.15.resid_out"])
def test_site_norm_matches_the_median_token_norm_of_news_text(site):
    model, tok = models.load("smollm2-135m")
    lens = conceptlens.attach(model, tok)
    batch = encode_batch(tok, data.load("bbc-news", "test").texts[:8], 96)
    with torch.no_grad(), lens.capture(site) as cap:
        acts, meta = cap.forward(**batch)
    typical = float(acts[site][meta.position > 0].norm(dim=1).median())
    assert site_norm(lens, site) == pytest.approx(typical, rel=0.15)
    direction = torch.randn(576, generator=torch.Generator().manual_seed(0))
    with lens.steer(Add(direction, 0.5, scale="site_norm", site=site)) as scope:
        (edit,) = scope.edits
    assert float(edit.vector.norm()) == pytest.approx(0.5 * site_norm(lens, site), rel=1e-5)
