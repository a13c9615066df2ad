"""Bad values are refused where they are made, in one line naming the value and the valid choices."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import conceptlens
from conceptlens import ConceptSet
from conceptlens.concepts import TopKSAE, VQCodebook
from conceptlens.concepts.kmeans import StreamingKMeans
from conceptlens.steering import Add, Clamp, CodeAblate, ProjectOut
from tests.conftest import CharTokenizer, hook_snapshot, tiny_inputs, tiny_model
from tests.faults import one_line_error

SITE = "blocks.0.resid_out"
DOCS = [f"text {i} " + "qrstuvw"[i % 5:] * (1 + i % 3) for i in range(12)]


@pytest.fixture(scope="module")
def lens():
    return conceptlens.attach(tiny_model("llama"), CharTokenizer())


@pytest.fixture(scope="module")
def sae():
    sae = TopKSAE(width=16, k=2, batch_size=64, warmup_tokens=64)
    sae.update(torch.randn(256, 32, generator=torch.Generator().manual_seed(0)))
    sae.flush()
    sae.site = SITE
    return sae


_error = one_line_error


@pytest.mark.parametrize("alpha", [math.nan, math.inf, -math.inf, True])
def test_add_refuses_a_non_finite_alpha_when_built(alpha):
    _error(ValueError, lambda: Add(torch.ones(32), alpha, site=SITE), "alpha", repr(alpha))


@pytest.mark.parametrize("edit", [Add, ProjectOut])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_edits_refuse_directions_with_nan_or_inf(edit, bad):
    directions = torch.randn(3, 32)
    directions[1, 5] = bad
    _error(ValueError, lambda: edit(ConceptSet(directions, site=SITE)), "[1]", "NaN or inf")


def test_clamp_refuses_a_non_finite_value_and_bad_latents(sae):
    _error(ValueError, lambda: Clamp(sae, latent=3, value=math.nan), "value", "nan")
    _error(ValueError, lambda: Clamp(sae, latent=True, value=0.0), "latent", "True")
    _error(ValueError, lambda: Clamp(sae, latent=16, value=0.0), "16 latents")
    _error(ValueError, lambda: CodeAblate(VQCodebook(4, init_size=8), codes=[1, False], site=SITE), "codes")


def test_a_direction_of_the_wrong_width_fails_when_the_scope_is_built(lens):
    snap = hook_snapshot(lens.model)
    _error(ValueError, lambda: lens.steer(Add(torch.ones(31), 2.0, site=SITE)), "width 31", "width 32", SITE)
    _error(ValueError, lambda: lens.steer(ProjectOut(torch.ones(2, 48), site="blocks.1.attn.k")), "width 16")
    assert hook_snapshot(lens.model) == snap


def test_an_sae_of_the_wrong_width_fails_when_the_scope_is_built(lens, sae):
    _error(ValueError, lambda: lens.steer(Clamp(sae, latent=1, value=0.0, site="blocks.1.attn.k")), "width 16")


def test_nan_never_reaches_the_logits(lens):
    with pytest.raises(ValueError):
        lens.steer(Add(torch.ones(32), math.nan, site=SITE))
    with torch.no_grad():
        assert torch.isfinite(lens.model(**tiny_inputs("llama")).logits).all()


def test_concepts_of_another_model_are_reported(lens):
    cs = ConceptSet(torch.randn(2, 32), site=SITE, model="HuggingFaceTB/SmolLM2-135M")
    with pytest.warns(UserWarning, match="recorded for model 'HuggingFaceTB/SmolLM2-135M'"):
        lens.steer(Add(cs, 1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lens.steer(Add(ConceptSet(torch.randn(2, 32), site=SITE, model=lens.name), 1.0))  # the same model: silent


@pytest.mark.parametrize("name", ["max_length", "batch_size", "max_tokens", "checkpoint_every"])
def test_fit_refuses_bools_where_ints_are_expected(lens, tmp_path, name):
    kwargs = {name: True, **({"checkpoint_dir": str(tmp_path)} if name == "checkpoint_every" else {})}
    _error(ValueError, lambda: lens.fit({SITE: StreamingKMeans(n_concepts=2)}, DOCS, progress=False, **kwargs),
           name, "True")


@pytest.mark.parametrize("make, names", [
    (lambda: StreamingKMeans(n_concepts=True), ["n_concepts", "True"]),
    (lambda: StreamingKMeans(4, batch_size=True), ["batch_size", "True"]),
    (lambda: VQCodebook(True), ["n_codes", "True"]),
    (lambda: VQCodebook(4, top_k=False), ["top_k", "False"]),
])
def test_extractors_refuse_bools_where_ints_are_expected(make, names):
    _error(ValueError, make, *names)


@pytest.mark.parametrize("name", ["eps", "temperature", "reseed_threshold"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, True])
def test_vq_checks_eps_temperature_and_reseed_threshold(name, value):
    _error(ValueError, lambda: VQCodebook(8, **{name: value}), name, repr(value))


@pytest.mark.parametrize("call, names", [
    (lambda lens: lens.fit({SITE: StreamingKMeans(n_concepts=2)}, DOCS, batchsize=4),
     ["'batchsize'", "did you mean 'batch_size'", "valid:", "max_length"]),
    (lambda lens: StreamingKMeans(n_concept=4), ["'n_concept'", "n_concepts", "spherical"]),
    (lambda lens: VQCodebook(8, temprature=0.5), ["'temprature'", "temperature"]),
    (lambda lens: Add(torch.ones(32), alhpa=2.0, site=SITE), ["'alhpa'", "alpha"]),
    (lambda lens: lens.steer(Add(torch.ones(32), site=SITE), position="all"), ["'position'", "positions"]),
])
def test_unknown_keyword_arguments_list_the_valid_names(lens, call, names):
    _error(TypeError, lambda: call(lens), *names)


def test_max_length_beyond_learned_positions_names_the_limit():
    lens = conceptlens.attach(tiny_model("gpt2"), CharTokenizer())  # 64 learned positions
    snap = hook_snapshot(lens.model)
    long_docs = ["x" * 200] * 3
    _error(ValueError, lambda: lens.fit({"blocks.0.resid_out": StreamingKMeans(n_concepts=2)}, long_docs,
                                        max_length=100, progress=False), "max_length=100", "64")
    assert hook_snapshot(lens.model) == snap
    report = lens.fit({"blocks.0.resid_out": StreamingKMeans(n_concepts=2, init_size=8)}, long_docs,
                      max_length=64, progress=False)
    assert report.tokens == 3 * 64
