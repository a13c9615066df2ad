"""SmolLM2 quantised by bitsandbytes (8-bit and 4-bit, on the CPU): capture, steering, fit."""

from __future__ import annotations

import warnings

import pytest
import torch

import conceptlens
from conceptlens import models
from conceptlens.concepts.kmeans import StreamingKMeans
from conceptlens.steering.edits import Add

bnb = pytest.importorskip("bitsandbytes")  # a dependency (scripts/setup.sh); skip only where it cannot import
TEXTS = ["The bank raised interest rates again.", "A cat sat on the warm mat.", "Stocks fell sharply on Monday.",
         "The striker scored twice in the final.", "Parliament debated the new bill.", "Hi"] * 2


@pytest.fixture(scope="module", params=["8bit", "4bit"])
def quantized(request):
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_8bit=True) if request.param == "8bit" else BitsAndBytesConfig(load_in_4bit=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, tok = models.load("smollm2-135m", quantization_config=config, device_map="cpu")
    layer = type(model.model.layers[3].mlp.down_proj).__name__
    assert layer == ("Linear8bitLt" if request.param == "8bit" else "Linear4bit")
    tok.padding_side = "left"
    return model, tok


@pytest.mark.real_model
def test_quantized_capture_steering_and_fit(quantized):
    model, tok = quantized
    lens = conceptlens.attach(model, tok)
    batch = tok(TEXTS[:3], return_tensors="pt", padding=True)
    keep = batch["attention_mask"].bool()
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
        with lens.capture(["blocks.15.resid_out", "blocks.15.attn.k"]) as cap:
            acts, _ = cap.forward(**batch)
    assert torch.equal(acts["blocks.15.resid_out"], out.hidden_states[16][keep].float())
    assert acts["blocks.15.attn.k"].shape == (int(keep.sum()), 3, 64)

    direction = acts["blocks.15.resid_out"].mean(0)
    direction = direction / direction.norm()
    with torch.no_grad():
        with lens.steer(Add(direction, alpha=40.0, site="blocks.15.resid_out")):
            steered = model(**batch).logits
        with lens.steer(Add(direction, alpha=40.0, site="blocks.15.resid_out"),
                        Add(direction, alpha=-40.0, site="blocks.15.resid_out")):
            cancelled = model(**batch).logits
    assert torch.equal(cancelled, out.logits) and not torch.allclose(steered, out.logits, atol=1e-2)

    km = StreamingKMeans(n_concepts=4, init_size=16, seed=0)
    report = lens.fit({"blocks.15.resid_out": km}, TEXTS, batch_size=6, max_length=16, progress=False)
    cs = report.concepts["blocks.15.resid_out"]
    assert cs.directions.shape == (4, 576) and torch.isfinite(cs.directions).all()
    assert report.rows["blocks.15.resid_out"]["kept"] > 16


@pytest.mark.real_model
def test_models_load_passes_dtype_and_device_map_to_registered_names(tmp_path):
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers": "cpu",
                  "model.norm": "disk", "lm_head": "disk"}
    plain, _ = models.load("smollm2-135m", dtype=torch.bfloat16)
    mapped, _ = models.load("smollm2-135m", dtype=torch.bfloat16, device_map=device_map,
                            offload_folder=str(tmp_path))
    assert plain.dtype == mapped.dtype == torch.bfloat16
    assert mapped.hf_device_map == device_map and mapped.model.norm.weight.device.type == "meta"  # on disk
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    got = []
    for model in (plain, mapped):
        with conceptlens.attach(model).capture(["blocks.2.resid_out", "final"], dtype="model") as cap:
            got.append(cap.forward(input_ids=ids)[0])
    for name in ("blocks.2.resid_out", "final"):
        assert got[0][name].dtype == torch.bfloat16 and torch.equal(got[0][name], got[1][name])
