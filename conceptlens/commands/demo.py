"""`conceptlens demo`: the main job on the embedded defaults, offline.

Loads SmolLM2-135M, lists a few of its sites, measures the attention-sink tokens at a
middle block, stream-fits k-means concepts there over BBC News articles without saving
activations, and steers generation with a direction read from the model's unembedding.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from conceptlens.commands._args import data_source, nonempty_text, out_dir, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--site", default="blocks.15.resid_out")
    parser.add_argument("--data", type=data_source, default="bbc-news", help="bundled set name, .txt or .jsonl path")
    parser.add_argument("--max-tokens", type=positive_int, default=30_000)
    parser.add_argument("--concepts", type=positive_int, default=32, help="number of k-means concepts")
    parser.add_argument("--word", type=nonempty_text, default=" wedding", help="steer towards this token's unembedding")
    parser.add_argument("--steer-site", default="blocks.20.resid_out", help="where the word direction is added")
    parser.add_argument("--out", type=out_dir, default="runs/demo", help="folder for the checkpoint and concept set")


def run(args: argparse.Namespace) -> int:
    import conceptlens
    from conceptlens import data
    from conceptlens.commands._common import load_model
    from conceptlens.concepts.kmeans import StreamingKMeans

    model, tok = load_model(args)
    lens = conceptlens.attach(model, tok)
    site = lens.site(args.site)
    print(f"{lens}\n")
    for name in ("embed", args.site, f"blocks.{site.name.split('.')[1]}.attn.k", "final"):
        print(" ", lens.site(name).describe())

    texts = data.load(args.data).texts if isinstance(args.data, str) and not Path(args.data).exists() else args.data
    _sink_statistics(lens, tok, texts[:32], site.name)

    print(f"\nStream-fitting {args.concepts} k-means concepts at {site.name} on up to {args.max_tokens:,} tokens")
    report = lens.fit({site.name: StreamingKMeans(n_concepts=args.concepts)}, texts, max_tokens=args.max_tokens,
                      checkpoint_dir=args.out, checkpoint_every=max(args.max_tokens // 3, 1))
    print(report.summary())
    concepts = report.concepts[site.name]
    print(f"concept set saved under {args.out}/concepts: {concepts}")

    _steering_demo(lens, tok, lens.site(args.steer_site).name, args.word)
    return 0


def _sink_statistics(lens, tok, texts: list[str], site: str) -> None:
    batch = tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=128)
    with lens.capture(site) as cap:
        acts = cap.forward(**batch)[site]
    meta = cap.last[1]
    norms = acts.norm(dim=1)
    first = meta.position == 0
    centred = acts - acts.mean(0)
    share = centred[first].pow(2).sum() / centred.pow(2).sum()
    print(f"\n{site} over {len(texts)} documents ({len(acts):,} tokens): median norm {norms.median():.0f}, "
          f"first-token norm {norms[first].median():.0f} ({first.float().mean():.1%} of tokens carry "
          f"{share:.1%} of the variance) - fits skip these attention sinks")


def _steering_demo(lens, tok, site: str, word: str) -> None:
    from conceptlens.steering import Add, site_norm

    model = lens.model
    word_id = tok(word, add_special_tokens=False)["input_ids"][0]
    direction = model.get_output_embeddings().weight[word_id].detach()
    prompt = tok(["I went to the shop and"], return_tensors="pt")
    print(f"\nSteering at {site} along the unembedding of {word!r} (positions='generated'); alpha is in "
          f"multiples of the site's median token norm ({site_norm(lens, site):.1f}):")
    for alpha in (0.0, 0.5, 1.0):  # scale="site_norm": the same alphas mean the same on any model
        with torch.no_grad(), lens.steer(Add(direction, alpha, scale="site_norm", site=site), positions="generated"):
            out = model.generate(**prompt, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
        text = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"  alpha {alpha:4.2f}: {text!r}")
