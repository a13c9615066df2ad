"""Steer generation with a concept fitted on the fly: unsteered vs steered, side by side.

    python examples/steer.py [--model smollm2-135m] [--max-tokens 20000] [--alpha 0.5]

Fits k-means concepts on BBC News sport articles at a middle block, takes the concept whose
centred direction (centroid minus the fit's mean activation: what it adds to a typical token) is
longest, the most distinctive, and adds it, scaled to `alpha` times the site's robust token norm,
to every generated token.
"""

import argparse

import torch

import conceptlens
from conceptlens import data, models
from conceptlens.concepts.kmeans import StreamingKMeans
from conceptlens.steering import Add

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default="smollm2-135m")
parser.add_argument("--max-tokens", type=int, default=20_000)
parser.add_argument("--alpha", type=float, default=0.5, help="multiple of the site's robust token norm")
parser.add_argument("--prompt", default="My favourite recipe is")
args = parser.parse_args()

model, tok = models.load(args.model)
lens = conceptlens.attach(model, tok)
site = f"blocks.{lens.adapter.n_blocks[''] // 2}.resid_out"
bbc = data.load("bbc-news")
sport = [t for t, label in zip(bbc.texts, bbc.labels) if label == "sports"]
report = lens.fit({site: StreamingKMeans(n_concepts=16, seed=0)}, sport, max_tokens=args.max_tokens, progress=False)
centred = report.concepts[site].centred()  # raw centroids point mostly along the mean activation
pick = int(centred.directions.norm(dim=1).argmax())

prompt = tok([args.prompt], return_tensors="pt")
for alpha in (0.0, args.alpha):
    with torch.no_grad(), lens.steer(Add(centred[pick], alpha, scale="robust_norm"), positions="generated"):
        out = model.generate(**prompt, max_new_tokens=20, do_sample=False, pad_token_id=tok.eos_token_id)
    text = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"alpha {alpha:4.2f} x the robust token norm along concept {pick}: {text!r}")
