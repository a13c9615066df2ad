"""Steering samples of the description pass: concepts named SET:INDEX, each swept over alpha."""

from __future__ import annotations

import json

import pytest
import torch

import conceptlens
from conceptlens import ConceptSet
from conceptlens.describe import SteeringRequest
from conceptlens.filters import FilterConfig
from conceptlens.steering import Add, sweep
from conceptlens.steering.sweep_scores import ConceptExpression
from conceptlens.steering.units import robust_norm
from tests.conftest import tiny_model
from tests.steering.test_sweep import word_tokenizer

SITE = "blocks.1.resid_out"
DOCS = [" ".join(f"w{3 + (7 * i + j) % 90}" for j in range(10)) for i in range(12)]
PROMPTS = ("w5 w6 w7", "w20 w21", "w40 w41 w42 w43")


@pytest.fixture(scope="module")
def lens():
    model = tiny_model("llama")
    model.generation_config.eos_token_id = 1
    return conceptlens.attach(model, word_tokenizer())


def describe(lens, sets, request):
    return lens.describe(sets, DOCS, max_length=16, progress=False, top_n=2, window=(2, 1),
                         filters=FilterConfig(max_norm_ratio=None), steering=request)


def test_each_named_concept_is_the_sweep_of_its_centred_direction(lens):
    g = torch.Generator().manual_seed(0)
    km = ConceptSet(torch.randn(4, 32, generator=g), SITE, method="kmeans", mean=torch.randn(32, generator=g))
    other = ConceptSet(torch.randn(3, 32, generator=g), SITE, method="custom")
    request = SteeringRequest(["km:2", "km:0"], prompts=PROMPTS, alphas=(0.0, 1.0, 8.0), max_new_tokens=4)
    out = describe(lens, {"km": km, "other": other}, request)
    assert out["other"].info["steering"] == []  # only the named concepts, of the named set
    first, second = out["km"].info["steering"]
    assert (first["concept"], first["name"], second["concept"]) == (2, "km:2", 0)
    direction = km.centred().directions[2]
    reference = sweep(lens, Add(direction, 1.0, scale="robust_norm", site=SITE), [0.0, 1.0, 8.0], list(PROMPTS),
                      ConceptExpression(lens, direction, SITE, mean=km.mean), positions="all", max_new_tokens=4)
    assert [s["texts"] for s in first["samples"]] == reference.texts
    assert [s["text"] for s in first["samples"]] == [t[0] for t in reference.texts]
    assert [s["score"] for s in first["samples"]] == pytest.approx(reference.mean.tolist())
    assert first["chosen_alpha"] == reference.best_alpha
    assert [s["fluent"] for s in first["samples"]] == reference.fluent
    assert first["norm"] == robust_norm(lens, SITE) and first["scale"] == "robust_norm"
    assert first["prompts"] == list(PROMPTS) and first["budget"] == 2.0
    json.dumps(out["km"].info, allow_nan=False)  # a page can read it: no NaN


@pytest.mark.parametrize("concepts, message", [
    (["km:9"], r"steering concept km:9 is out of range: 'km' has 4 concepts \(0-3\)"),
    (["topk:1"], r"set 'topk', which is not described here; the sets are \['km'\]"),
    (["12"], r"steering concept '12' is not SET:INDEX"),
])
def test_bad_names_fail_before_the_pass(lens, concepts, message):
    km = ConceptSet(torch.randn(4, 32), SITE, method="kmeans")
    with pytest.raises(ValueError, match=message):
        describe(lens, {"km": km}, SteeringRequest(concepts))
