"""Gauge audit of SmolLM2 (rotary, grouped-query attention) with q/k read at the lens sites."""

from __future__ import annotations

import pytest
import torch

from conceptlens import models
from conceptlens.metrics.capture_qk import qk_capture
from conceptlens.metrics.gauge_audit import gauge_audit

INVARIANT = ("key_distance", "score_cosine", "qk_spectrum")


@pytest.mark.real_model
def test_smollm2_rotary_gauge_keeps_logits_and_moves_only_raw_key_geometry():
    model, tok = models.load("smollm2-135m")
    before = {name: p.clone() for name, p in model.named_parameters() if "_proj" in name}
    tok.padding_side = "left"
    inputs = tok(["The bank raised interest rates again on Tuesday.", "A cat sat on the mat."],
                 return_tensors="pt", padding=True)
    report = gauge_audit(model, inputs, capture_qk=qk_capture(layers=[0, 10, -1]), seed=7)
    print(report)
    assert report.group == "rotary"
    assert report.logits_max_abs_diff < 1e-3, report
    for name in INVARIANT:
        assert report.relative_change[name] < 1e-4, (name, report.relative_change)
    for name in ("key_cosine", "key_norm"):
        assert report.relative_change[name] > 1e-2, (name, report.relative_change)
    assert sorted(report.per_layer["key_norm"]) == [0, 10, 29]
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters() if "_proj" in name)
