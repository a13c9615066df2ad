"""CE-loss recovered for transcoders, cross-layer transcoders and crosscoders, against the
model's own modules and against `splice_ce` where one site is replaced."""

import copy

import pytest
import torch

import conceptlens
from conceptlens.metrics.splice import splice_ce
from conceptlens.metrics.splice_sites import splice_crosscoder, splice_replacement
from tests.conftest import tiny_inputs, tiny_model


def _lens():
    return conceptlens.attach(tiny_model("llama"))


class ExactMLPs:
    """A 'cross-layer transcoder' that is the model's own MLPs: output l = MLP_l(input l)."""

    method = "cross_layer_transcoder"

    def __init__(self, lens, scale=1.0):
        self.mlps = [copy.deepcopy(m.mlp) for m in lens.model.model.layers]  # copies: the sites hook the originals
        self.scale = scale

    def reconstruct(self, xs):
        return [self.scale * mlp(x) for mlp, x in zip(self.mlps, xs)]


class ExactTranscoder(ExactMLPs):
    method = "transcoder"

    def reconstruct(self, x):
        return self.scale * self.mlps[1](x)


INS, OUTS = ["blocks.0.mlp.in", "blocks.1.mlp.in"], ["blocks.0.mlp_out", "blocks.1.mlp_out"]


def test_the_models_own_mlps_recover_everything():
    lens, batch = _lens(), tiny_inputs("llama", length=9)
    r = splice_replacement(lens, INS, OUTS, ExactMLPs(lens), batch)
    assert r.spliced == pytest.approx(r.clean, abs=1e-5) and r.recovered == pytest.approx(1.0, abs=1e-3)
    one = splice_replacement(lens, INS[1:], OUTS[1:], ExactTranscoder(lens), batch)
    assert one.spliced == pytest.approx(one.clean, abs=1e-5)
    assert r.zero_ablated != one.zero_ablated  # both MLPs zeroed against one


def test_replacement_is_causal_later_inputs_see_earlier_replacements():
    """Halving MLP 0's output changes what MLP 1 reads: the replacement's loss equals that of a model
    whose MLP outputs are halved (both layers), computed with plain forward hooks on HF's modules."""
    lens, batch = _lens(), tiny_inputs("llama", length=9)
    where = batch["attention_mask"].bool() & (batch["attention_mask"].cumsum(1) > 1)
    handles = [m.mlp.register_forward_hook(lambda mod, args, out: torch.where(where[..., None], 0.5 * out, out))
               for m in lens.model.model.layers]
    try:
        with torch.no_grad():
            reference = splice_ce(lens, "blocks.0.resid_out", lambda x: x.clone(), batch).clean
    finally:
        for h in handles:
            h.remove()
    r = splice_replacement(lens, INS, OUTS, ExactMLPs(lens, scale=0.5), batch)
    assert r.spliced == pytest.approx(reference, rel=1e-5)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in lens.model.modules())


class Halver:
    """A 'crosscoder' whose reconstruction of each site is half the site."""

    def reconstruct(self, *xs):
        return [0.5 * x for x in xs]


def test_crosscoder_splice_is_splice_ce_one_site_at_a_time():
    lens, batch = _lens(), tiny_inputs("llama", length=9)
    sites = ["blocks.0.resid_out", "blocks.1.attn_out"]
    per_site = splice_crosscoder(lens, sites, Halver(), batch)
    for site in sites:
        reference = splice_ce(lens, site, lambda x: 0.5 * x, batch)
        got = per_site[site]
        assert got.clean == pytest.approx(reference.clean, rel=1e-6)
        assert got.spliced == pytest.approx(reference.spliced, rel=1e-5)
        assert got.zero_ablated == pytest.approx(reference.zero_ablated, rel=1e-6)
        assert got.tokens == reference.tokens


def test_inputs_and_targets_must_differ():
    lens, batch = _lens(), tiny_inputs("llama", length=9)
    with pytest.raises(ValueError, match="distinct sites"):
        splice_replacement(lens, OUTS, OUTS, ExactMLPs(lens), batch)
