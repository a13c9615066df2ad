"""Stream-fit concepts without saving activations, describe them, and open the report.

    python examples/fit_and_report.py [--model smollm2-135m] [--max-tokens 30000] [--out runs/example]

One pass over BBC News feeds a TopK SAE and k-means at the same middle block (activations go
straight from the hooks into the extractors); a second pass over held-out articles records
each concept's top contexts, histogram and topic probes; the report is a static site.
"""

import argparse
import random
from pathlib import Path

import conceptlens
from conceptlens import data, models
from conceptlens.concepts.kmeans import StreamingKMeans
from conceptlens.concepts.sae import TopKSAE
from conceptlens.report import write_report

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default="smollm2-135m")
parser.add_argument("--max-tokens", type=int, default=30_000)
parser.add_argument("--out", default="runs/example")
args = parser.parse_args()

lens = conceptlens.attach(*models.load(args.model))
site = f"blocks.{lens.adapter.n_blocks[''] // 2}.resid_out"
train, test = data.load("bbc-news", "train"), data.load("bbc-news", "test")  # stored in topic order
random.Random(0).shuffle(order := list(range(len(test))))
extractors = {site: {"topk": TopKSAE(width=256, k=16, batch_size=1024, seed=0),
                     "kmeans": StreamingKMeans(n_concepts=32, seed=0)}}
texts = random.Random(1).sample(train.texts, len(train))
report = lens.fit(extractors, texts, max_tokens=args.max_tokens, checkpoint_dir=args.out, progress=False)
print(report.summary())
lens.describe(report.concepts, [test.texts[i] for i in order], labels=[test.labels[i] for i in order],
              label_names=test.label_names, max_tokens=args.max_tokens // 2, out=str(Path(args.out) / "describe"),
              progress=False)
summary = write_report(args.out)
print(f"{summary.pages} pages, {summary.bytes / 1e6:.1f} MB: open {summary.path.resolve().as_uri()}")
