"""Ablate concepts during an evaluation, against random directions of the same rank.

    python examples/ablate.py [--model smollm2-135m] [--max-tokens 20000] [--texts 60]

Fits 8 k-means concepts at a middle block, projects their centred directions (centroid minus the
fit's mean activation) out while a linear topic probe (trained on clean activations of a later
block) reads BBC News test articles, and compares the probe's log-loss with the harm done by 5
sets of random directions of the same rank drawn with the activations' covariance.
"""

import argparse

import conceptlens
from conceptlens import data, models
from conceptlens.concepts.kmeans import StreamingKMeans
from conceptlens.metrics.faithfulness import ProbeTask, faithfulness

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default="smollm2-135m")
parser.add_argument("--max-tokens", type=int, default=20_000)
parser.add_argument("--texts", type=int, default=60, help="held-out articles for the probe")
args = parser.parse_args()

model, tok = models.load(args.model)
lens = conceptlens.attach(model, tok)
n = lens.adapter.n_blocks[""]
site, probe_site = f"blocks.{n // 2}.resid_out", f"blocks.{n - 1}.resid_out"
cs = lens.fit({site: StreamingKMeans(n_concepts=8, seed=0)}, "bbc-news", max_tokens=args.max_tokens,
              progress=False).concepts[site].centred()  # raw centroids point mostly along the mean

test = data.load("bbc-news", "test")
step = max(1, len(test) // args.texts)  # spread over the topics
texts, labels = test.texts[::step][:args.texts], test.labels[::step][:args.texts]
result = faithfulness(lens, cs, texts, task=ProbeTask(labels, site=probe_site), n_controls=5, max_length=64)
print(f"ablating {len(cs)} k-means concepts at {site}, probe at {probe_site}:")
print(" ", result.summary())
