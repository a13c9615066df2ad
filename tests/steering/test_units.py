"""Steering strength in one unit (`scale=`) and the three ablation modes, against hand computations."""

from __future__ import annotations

import pytest
import torch

import conceptlens
from conceptlens import ConceptSet
from conceptlens.steering import Ablate, Add, ProjectOut, site_norm
from conceptlens.steering.units import PROBE_TEXT, PROBE_TOKENS
from tests.conftest import tiny_model

SITE = "blocks.1.resid_out"


def scaled_model(factor: float) -> torch.nn.Module:
    """The tiny Llama with its embeddings multiplied by `factor`: residual norms scale with it."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(factor)
    return model


def site_acts(lens, ids, *edits):
    """(B, T, d) activations at SITE for token ids `(B, T)`, under `edits` if any."""
    with torch.no_grad():
        if edits:
            with lens.steer(*edits), lens.capture(SITE, keep_shape=True) as cap:
                lens.model(ids)
        else:
            with lens.capture(SITE, keep_shape=True) as cap:
                lens.model(ids)
    return cap.last[0][SITE]


def test_site_norm_is_the_median_token_norm_of_the_probe_tokens_without_the_first():
    lens = conceptlens.attach(tiny_model("llama"))
    ids = torch.randint(3, 99, (len(PROBE_TEXT), PROBE_TOKENS), generator=torch.Generator().manual_seed(0))
    norms = site_acts(lens, ids)[:, 1:].flatten(0, 1).double().norm(dim=1)
    assert site_norm(lens, SITE) == pytest.approx(float(norms.median()), rel=1e-6)
    assert lens._site_norms == {SITE: site_norm(lens, "blocks.-1.resid_out")}  # measured once, canonical name


def test_the_same_site_norm_alpha_gives_comparable_edits_on_models_of_very_different_scales():
    ids = torch.randint(3, 99, (4, 12), generator=torch.Generator().manual_seed(5))  # not the probe tokens
    direction = torch.randn(32, generator=torch.Generator().manual_seed(1))
    ratios = {}
    for factor in (1.0, 300.0):
        lens = conceptlens.attach(scaled_model(factor))
        clean = site_acts(lens, ids)
        typical = clean[:, 1:].norm(dim=-1).median()
        for scale in ("unit", "site_norm"):
            delta = site_acts(lens, ids, Add(direction, 0.5, scale=scale, site=SITE)) - clean
            ratios[factor, scale] = float(delta.norm(dim=-1).mean() / typical)
        assert ratios[factor, "site_norm"] * float(typical) == pytest.approx(0.5 * site_norm(lens, SITE), rel=1e-4)
    scale_gap = site_norm(conceptlens.attach(scaled_model(300.0)), SITE) / site_norm(
        conceptlens.attach(scaled_model(1.0)), SITE)
    assert scale_gap > 50  # the two models really differ in scale
    for factor in (1.0, 300.0):  # half a typical token on both (the typical norm of other text, within 30%)
        assert 0.35 < ratios[factor, "site_norm"] < 0.65
    assert ratios[1.0, "unit"] / ratios[300.0, "unit"] > 50  # a unit vector means a different thing on each


def test_raw_and_unit_scales_and_their_errors():
    v = torch.tensor([3.0, 4.0] + [0.0] * 30)
    assert torch.equal(Add(v, 2.0, site=SITE).vector, 2 * v)
    torch.testing.assert_close(Add(v, 2.0, scale="unit", site=SITE).vector, 2 * v / 5)
    torch.testing.assert_close(Add(v, 2.0, scale="site_norm", norm=10.0, site=SITE).vector, 2 * 10 * v / 5)
    torch.testing.assert_close(Add(torch.stack([v, v]), 1.0, scale="unit", site=SITE).vector, v / 5)  # sum, then unit
    with pytest.raises(ValueError, match=r"scale must be one of \('raw', 'unit', 'site_norm'\); got 'norm'"):
        Add(v, 1.0, scale="norm", site=SITE)
    with pytest.raises(RuntimeError, match="when a steering scope is built"):
        Add(v, 1.0, scale="site_norm", site=SITE).vector
    with pytest.raises(ValueError, match="nonzero norm"):
        Add(torch.zeros(32), 1.0, scale="unit", site=SITE)


def test_ablation_modes_by_hand():
    g = torch.Generator().manual_seed(0)
    directions, mean = torch.randn(2, 32, generator=g), 3 * torch.randn(32, generator=g)
    cs = ConceptSet(directions, site=SITE, method="kmeans", mean=mean)
    x = torch.randn(2, 5, 32, generator=g) + mean
    q = torch.linalg.qr(directions.T.double()).Q.T.float()  # (2, d) orthonormal basis of the span
    projected = x - (x @ q.T) @ q
    torch.testing.assert_close(Ablate(cs, "projection").apply(x, None), ProjectOut(cs).apply(x, None))
    torch.testing.assert_close(Ablate(cs, "projection").apply(x, None), projected, atol=1e-5, rtol=0)
    meaned = Ablate(cs, "mean").apply(x, None)
    torch.testing.assert_close(meaned, projected + (mean @ q.T) @ q, atol=1e-5, rtol=0)
    torch.testing.assert_close(meaned @ q.T, (mean @ q.T).expand(2, 5, 2), atol=1e-4, rtol=0)  # component = mean's
    torch.testing.assert_close(Ablate(cs, "mean").apply(mean[None, None], None), mean[None, None], atol=1e-5, rtol=0)
    mask = torch.tensor([[False, True, True, True, True]] * 2)
    zeroed = Ablate(cs, "zero").apply(x, mask)
    assert torch.equal(zeroed[:, 0], x[:, 0]) and not zeroed[:, 1:].any()
    with pytest.raises(ValueError, match="mode='mean' needs the mean"):
        Ablate(ConceptSet(directions, site=SITE), "mean")
    with pytest.raises(ValueError, match="mode must be one of"):
        Ablate(cs, "resample")


def test_lens_ablate_modes_edit_the_model():
    lens = conceptlens.attach(tiny_model("llama"))
    ids = torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(2))
    clean = site_acts(lens, ids)
    cs = ConceptSet(torch.randn(1, 32, generator=torch.Generator().manual_seed(3)), site=SITE,
                    mean=clean[:, 1:].flatten(0, 1).mean(0))
    u = cs.directions[0] / cs.directions[0].norm()
    with torch.no_grad(), lens.ablate(cs, mode="mean", positions=slice(1, None)), \
            lens.capture(SITE, keep_shape=True) as cap:
        lens.model(ids)
    edited = cap.last[0][SITE]
    torch.testing.assert_close(edited[:, 0], clean[:, 0])  # position 0 left alone
    torch.testing.assert_close(edited[:, 1:] @ u, (cs.mean @ u).expand(2, 5), atol=1e-4, rtol=0)
