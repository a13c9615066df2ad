"""Steering strength in one unit (`scale=`) and the three ablation modes, against hand computations."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import conceptlens
from conceptlens import ConceptSet
from conceptlens.steering import Ablate, Add, ProjectOut, SteeringVector, robust_norm, site_norm
from conceptlens.steering.units import PROBE_TEXT, PROBE_TOKENS, site_scale
from tests.conftest import Batches, tiny_model

SITE = "blocks.1.resid_out"


def scaled_model(factor: float) -> torch.nn.Module:
    """The tiny Llama with its embeddings multiplied by `factor`: residual norms scale with it."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(factor)
    return model


def site_acts(lens, ids, *edits):
    """(B, T, d) activations at SITE for token ids `(B, T)`, under `edits` if any."""
    seen = Batches()
    with torch.no_grad():
        if edits:
            with lens.steer(*edits), lens.capture(SITE, keep_shape=True, on_batch=seen):
                lens.model(ids)
        else:
            with lens.capture(SITE, keep_shape=True, on_batch=seen):
                lens.model(ids)
    return seen.acts[SITE]


def test_site_norm_is_the_median_token_norm_of_the_probe_tokens_without_the_first():
    lens = conceptlens.attach(tiny_model("llama"))
    ids = torch.randint(3, 99, (len(PROBE_TEXT), PROBE_TOKENS), generator=torch.Generator().manual_seed(0))
    norms = site_acts(lens, ids)[:, 1:].flatten(0, 1).double().norm(dim=1)
    assert site_norm(lens, SITE) == pytest.approx(float(norms.median()), rel=1e-6)
    assert list(lens.hooks.site_norms) == [SITE]  # measured once, under the canonical name
    assert site_scale(lens, "blocks.-1.resid_out") is site_scale(lens, SITE)


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
    with pytest.raises(ValueError, match=r"one of \('raw', 'unit', 'robust_norm', 'site_norm'\); got 'norm'"):
        Add(v, 1.0, scale="norm", site=SITE)
    torch.testing.assert_close(Add(v, 2.0, scale="robust_norm", norm=10.0, site=SITE).at(-3.0).vector, -3 * 10 * v / 5)
    for scale in ("robust_norm", "site_norm"):
        with pytest.raises(RuntimeError, match=f"Add\\(scale='{scale}'\\) learns .* when a steering scope is built"):
            Add(v, 1.0, scale=scale, site=SITE).vector
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
    seen = Batches()
    with torch.no_grad(), lens.ablate(cs, mode="mean", positions=slice(1, None)), \
            lens.capture(SITE, keep_shape=True, on_batch=seen):
        lens.model(ids)
    edited = seen.acts[SITE]
    torch.testing.assert_close(edited[:, 0], clean[:, 0])  # position 0 left alone
    torch.testing.assert_close(edited[:, 1:] @ u, (cs.mean @ u).expand(2, 5), atol=1e-4, rtol=0)


MASSIVE_AT = 5  # the coordinate that carries the planted massive activation


def _norms(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


def massive_twins(factor: float = 30.0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The tiny Llama with coordinate MASSIVE_AT taken out of its residual stream (no embedding
    or sublayer writes it, no norm passes it on), and its twin where the embedding puts a
    constant `factor` times the typical token norm there at every token, as Gemma-3's massive
    activations do. Each norm of the twin scales its other weights by sqrt(r^2 + M^2) / r (r the
    median norm of that norm's input in the first model): what a model trained with a massive
    coordinate learns, so that both compute (nearly) the same function."""
    base = tiny_model("llama")
    with torch.no_grad():
        base.get_input_embeddings().weight[:, MASSIVE_AT] = 0
        for layer in base.model.layers:
            layer.self_attn.o_proj.weight[MASSIVE_AT] = 0
            layer.mlp.down_proj.weight[MASSIVE_AT] = 0
        for norm in _norms(base):
            norm.weight[MASSIVE_AT] = 0
    inputs: dict[int, torch.Tensor] = {}
    handles = [n.register_forward_pre_hook(lambda m, a, i=i: inputs.setdefault(i, a[0].detach()))
               for i, n in enumerate(_norms(base))]
    ids = torch.randint(3, 99, (len(PROBE_TEXT), PROBE_TOKENS), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            base(ids)
    finally:
        for h in handles:
            h.remove()
    typical = {i: float(x[:, 1:].norm(dim=-1).median()) for i, x in inputs.items()}
    planted = factor * site_norm(conceptlens.attach(base), SITE)
    twin = tiny_model("llama")
    twin.load_state_dict(base.state_dict())
    with torch.no_grad():
        twin.get_input_embeddings().weight[:, MASSIVE_AT] = planted
        for i, norm in enumerate(_norms(twin)):
            norm.weight.mul_(math.sqrt(typical[i] ** 2 + planted ** 2) / typical[i])
    return base, twin


def next_token_kl(lens, edit, ids) -> float:
    """Mean KL(clean || steered) of the next-token distributions, positions 1 on."""
    with torch.no_grad():
        clean = lens.model(ids).logits.double().log_softmax(-1)
        with lens.steer(edit, positions=slice(1, None)):
            steered = lens.model(ids).logits.double().log_softmax(-1)
    return float((clean.exp() * (clean - steered)).sum(-1)[:, 1:].mean())


def test_robust_norm_gives_the_same_effect_with_and_without_a_massive_coordinate():
    base, twin = massive_twins()
    ids = torch.randint(3, 99, (4, 12), generator=torch.Generator().manual_seed(5))  # not the probe tokens
    with torch.no_grad():  # the twins compute nearly the same function
        p, q = base(ids).logits.softmax(-1), twin(ids).logits.softmax(-1)
    assert float((p - q).abs().sum(-1).max()) < 0.1
    direction = torch.randn(32, generator=torch.Generator().manual_seed(1))
    direction[MASSIVE_AT] = 0  # along coordinates the model reads
    kl = {}
    for which, model in (("base", base), ("twin", twin)):
        lens = conceptlens.attach(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scale = site_scale(lens, SITE)
        dominated = [str(w.message) for w in caught if "massive activation" in str(w.message)]
        assert dominated == ([] if which == "base" else [dominated[0]])
        assert scale.massive == (() if which == "base" else (MASSIVE_AT,))
        for unit in ("robust_norm", "site_norm"):
            kl[which, unit] = next_token_kl(lens, Add(direction, 0.5, scale=unit, site=SITE), ids)
    assert f"coordinate {MASSIVE_AT} carries" in dominated[0]
    assert 1 / 1.5 < kl["twin", "robust_norm"] / kl["base", "robust_norm"] < 1.5
    assert kl["twin", "site_norm"] / kl["base", "site_norm"] > 5  # the plain norm counts the planted coordinate


def test_contrastive_vectors_and_keep_norm_edits_take_the_same_units():
    lens = conceptlens.attach(tiny_model("llama"))
    v = torch.randn(32, generator=torch.Generator().manual_seed(6))
    vec = SteeringVector({SITE: ConceptSet(v, SITE, method="contrastive-mean_diff")})
    for keep_norm in (False, True):
        with lens.steer(*vec.edits(0.5, scale="robust_norm", keep_norm=keep_norm)) as scope:
            (edit,) = scope.edits
        torch.testing.assert_close(edit.vector, 0.5 * robust_norm(lens, SITE) * v / v.norm())


def test_the_unit_is_measured_on_the_unsteered_model_whatever_scope_is_open():
    """The probe text's forward runs with every open scope suspended: an outer edit at the site changes
    neither the measured unit nor what an outer "prompt"/"generated" scope takes for its prompt."""
    reference = robust_norm(conceptlens.attach(tiny_model("llama")), SITE)  # the same weights, nothing open
    lens = conceptlens.attach(tiny_model("llama"))
    push = torch.randn(32, generator=torch.Generator().manual_seed(3))
    outer = lens.steer(Add(push, 50.0, site=SITE), positions="generated")
    with outer:
        inner = Add(torch.randn(32), 1.0, scale="robust_norm", site=SITE)
        with lens.steer(inner):  # its unit is measured now, with the outer scope open
            lens.model(torch.randint(3, 99, (2, 5)))  # the user's prompt: 2 rows
    assert inner.norm == reference
    assert [tuple(n.shape) for n in outer.prompt_length.values()] == [(2,)]


def test_the_unit_of_a_second_lens_on_the_model_is_measured_without_the_first_lenss_edits():
    reference = robust_norm(conceptlens.attach(tiny_model("llama")), SITE)  # the same weights, nothing open
    model = tiny_model("llama")
    first, second = conceptlens.attach(model), conceptlens.attach(model)
    push = torch.randn(32, generator=torch.Generator().manual_seed(3))
    with first.steer(Add(push, 10.0, site="blocks.0.resid_out")):
        edit = Add(torch.randn(32), 0.5, scale="robust_norm", site=SITE)
        second.steer(edit)  # measured now, with the first lens's edit open upstream
    assert edit.norm == reference == robust_norm(second, SITE)


def test_the_probe_texts_forward_reaches_no_capture_the_user_has_open():
    """On an encoder-decoder the probe runs the encoder whole, past an encoder site the user captures:
    its rows went to the user's on_batch as if they were a batch of the user's."""
    model = tiny_model("t5")
    lens = conceptlens.attach(model)
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(2))
    seen = Batches()
    with lens.capture("encoder.blocks.0.resid_out", on_batch=seen), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a random direction: the no-op check may warn)
        with lens.steer(ProjectOut(torch.randn(32), site="decoder.blocks.0.resid_out")), torch.no_grad():
            model(input_ids=ids, decoder_input_ids=ids[:, :3])  # the user's one forward
    assert len(seen) == 1 and len(seen.acts["encoder.blocks.0.resid_out"]) == ids.numel()


def test_one_edit_steering_two_models_applies_each_models_own_unit():
    ids = torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(5))
    small, large = conceptlens.attach(scaled_model(1.0)), conceptlens.attach(scaled_model(300.0))
    direction = torch.randn(32, generator=torch.Generator().manual_seed(1))
    edit = Add(direction, 0.5, scale="robust_norm", site=SITE)
    on_small = small.steer(edit)
    large.steer(edit)  # binds the same edit to the other model's unit, 300 times larger
    seen = Batches()
    with torch.no_grad(), on_small, small.capture(SITE, keep_shape=True, on_batch=seen):
        small.model(ids)
    delta = seen.acts[SITE] - site_acts(small, ids)
    want = 0.5 * robust_norm(small, SITE) * direction / direction.norm()
    torch.testing.assert_close(delta, want.expand_as(delta), rtol=1e-4, atol=1e-4)


def test_an_encoder_decoders_unit_reads_the_probe_texts_real_tokens_on_both_stacks():
    from conceptlens.steering.units import _measure, _probe_batch

    class Chars:  # one id per character; a single text gives one list of ids, as HF tokenizers do
        all_special_ids: list[int] = []

        def __call__(self, text, **kwargs):
            return {"input_ids": [3 + ord(c) % 96 for c in text]}

    lens = conceptlens.attach(tiny_model("t5"), Chars())
    mask = _probe_batch(lens)["attention_mask"]
    assert (mask == 0).any()  # the probe texts differ in length: right padding
    real = int(mask.sum()) - len(mask)  # every real token but each sequence's first
    assert len(_measure(lens, "encoder.blocks.0.resid_out")) == len(_measure(lens, "decoder.blocks.0.resid_out")) == real
