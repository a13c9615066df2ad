"""nnsight wrappers: attach takes them, captures and extractors run inside their traces (offline)."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

import conceptlens
from conceptlens.concepts.kmeans import StreamingKMeans
from conceptlens.steering.edits import Add
from tests.conftest import Batches, assert_same_state, hook_snapshot, tiny_inputs, tiny_model

nnsight = pytest.importorskip("nnsight")  # a test dependency (pyproject dev extra, scripts/setup.sh)
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "nnsight_trace.py"


def word_tokenizer():
    """A file-free fast tokenizer ("w3 w4" -> [3, 4]) for LanguageModel, which needs a real one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(99)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", pad_token="w1", eos_token="w2")


def example():
    spec = importlib.util.spec_from_file_location("nnsight_trace", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_attach_unwraps_nnsight_and_language_model():
    model, tok = tiny_model("llama"), word_tokenizer()
    lens = conceptlens.attach(nnsight.NNsight(model))
    assert lens.model is model and lens.tokenizer is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # LanguageModel is deprecated in favour of TransformersModel
        wrapped = nnsight.LanguageModel(model, tokenizer=tok)
    lens = conceptlens.attach(wrapped)
    assert lens.model is model and lens.tokenizer is tok and "blocks.1.attn.k" in lens.sites


def test_capture_and_steering_inside_a_trace_match_nnsight():
    model = tiny_model("llama")
    wrapper, lens = nnsight.NNsight(model), conceptlens.attach(nnsight.NNsight(model))
    inputs = tiny_inputs("llama")
    keep = inputs["attention_mask"].bool()
    before = hook_snapshot(model)
    cap = Batches()
    with lens.capture(["blocks.0.resid_out", "blocks.1.resid_out"], on_batch=cap):
        with wrapper.trace(**inputs):
            theirs = wrapper.model.layers[1].output.save()
    assert torch.equal(cap.acts["blocks.1.resid_out"], theirs[keep])
    vector = torch.randn(32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), lens.steer(Add(vector, site="blocks.0.resid_out")):
        ours = model(**inputs).logits
    with wrapper.trace(**inputs):
        wrapper.model.layers[0].output[:] += vector  # the same edit written in nnsight
        nn_logits = wrapper.output.logits.save()
    torch.testing.assert_close(ours, nn_logits)
    assert hook_snapshot(model) == before


def test_extractor_fed_inside_a_trace_equals_one_fed_by_capture():
    module = example()
    model = tiny_model("llama")
    wrapper = nnsight.NNsight(model)
    batches = [tiny_inputs("llama", batch=4, length=9, seed=s) for s in range(4)]
    a, b = StreamingKMeans(n_concepts=3, init_size=24, seed=0), StreamingKMeans(n_concepts=3, init_size=24, seed=0)
    module.fit_in_trace(wrapper, batches, 1, a)
    module.fit_with_capture(wrapper, batches, 1, b)
    assert a.state_dict()["n_seen"] > 24
    assert_same_state(a.state_dict(), b.state_dict())


@pytest.mark.real_model
def test_example_runs_on_smollm2():
    a, b = example().main(n_docs=8, layer=5, k=4)
    assert torch.equal(a.concept_set().directions, b.concept_set().directions)
