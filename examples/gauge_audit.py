"""Audit a metric's gauge invariance: which attention-geometry numbers are properties of the model?

    python examples/gauge_audit.py [--model smollm2-135m]

Scores q.k are unchanged when W_Q -> A W_Q and W_K -> A^-T W_K (A commuting with rotary), so a
metric that moves under a random such A describes the parametrisation, not the model. Here
the built-in metrics and one of our own (the mean key norm) are audited on two layers.
"""

import argparse

from conceptlens import models
from conceptlens.metrics.capture_qk import qk_capture
from conceptlens.metrics.gauge_audit import AUDIT_METRICS, gauge_audit

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default="smollm2-135m")
args = parser.parse_args()

model, tok = models.load(args.model)
texts = ["The match ended in a draw after extra time.", "Shares fell sharply as the bank reported losses."]
inputs = tok(texts, return_tensors="pt", padding=True)
metrics = {**AUDIT_METRICS, "mean key norm (ours)": lambda q, k: k.norm(dim=-1).mean()}
report = gauge_audit(model, inputs, capture_qk=qk_capture(layers=[0, 1]), metrics=metrics, seed=0)
print(report)
print("not gauge invariant:", ", ".join(report.moved()) or "none")
