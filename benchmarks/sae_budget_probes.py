"""Does a TopK SAE trained on more text beat its random TopK encoder on more probe topics?

    HF_HUB_OFFLINE=1 python benchmarks/sae_budget_probes.py --max-tokens 40000 --fit-length 256 \
        --fit-sets movie-polarity wsj-pos conll2010-uncertainty
    HF_HUB_OFFLINE=1 python benchmarks/sae_budget_probes.py --max-tokens 1000000 --fit-length 256 \
        --fit-sets movie-polarity --fit-batch 32 --ks 8 32 --lr-mults 2 1
    HF_HUB_OFFLINE=1 python benchmarks/sae_budget_probes.py --max-tokens 2000000 --fit-length 512 \
        --batch-size 512 --steps-for-lr 760 --ks 8 32 --lr-mults 2 1

The pool and protocol of `benchmarks/demo_defaults.py` (its `--seeds 0`, 720 train-split articles after
the first 400 of the seed's shuffled order, 3 folds, k = 5 code probes against 20 random TopK encoder
draws), but the SAEs (width 2048, one per `--ks` / `--lr-mults` pair) fit on other text: the bbc-news
train articles outside the pool (no pool text), with `--fit-sets`' train splits, shuffled with the
seed, read to `--max-tokens` or the end of the text. The demo's own SAE on the same pool is
`demo_defaults.py --seeds 0 --only b15_topk_w2048_k8_lr2x --lengths 64 --sites`. Prints, per SAE, the
fit's tokens, steps and FVU, wins of 15 (3 folds x 5 topics), the mean margin over the control and
the mean k = 5 accuracy (EVALUATION.md "Nor from a larger budget").
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import demo_defaults as dd  # noqa: E402

SITE = "blocks.15.resid_out"


def fit_texts(train: list[str], pooled: set[str], more: list[str], seed: int) -> list[str]:
    """The train articles that are no pool text, then `more`, shuffled with `seed`."""
    texts = [text for text in train if text not in pooled] + more
    random.Random(seed).shuffle(texts)
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=40_000)
    parser.add_argument("--fit-length", type=int, default=256, help="tokens the fit reads per document")
    parser.add_argument("--fit-sets", nargs="*", default=[], help="bundled sets whose train split the fit also reads")
    parser.add_argument("--fit-batch", type=int, default=16, help="documents per forward of the fit")
    parser.add_argument("--ks", type=int, nargs="+", default=[8])
    parser.add_argument("--lr-mults", type=float, nargs="+", default=[2.0],
                        help="one per --ks: the lr as a multiple of `short_budget_lr`")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="the SAE's batch (default: the demo's for --max-tokens, `commands.demo.sae_batch_size`)")
    parser.add_argument("--steps-for-lr", type=int, default=None,
                        help="with --batch-size: the steps `short_budget_lr` is computed for")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if len(args.lr_mults) != len(args.ks):
        parser.error(f"--lr-mults needs one value per --ks ({len(args.ks)}); got {len(args.lr_mults)}")
    if (args.batch_size is None) != (args.steps_for_lr is None):
        parser.error("--batch-size and --steps-for-lr go together")
    import conceptlens
    from conceptlens import data, models
    from conceptlens.concepts.sae.config import short_budget_lr

    torch.set_num_threads(args.threads)
    model, tok = models.load("smollm2-135m")
    lens = conceptlens.attach(model, tok)
    full = data.load("bbc-news", "train")
    pool = dd.pool_documents(full.texts, [args.seed], 400, 720)
    texts, labels = [full.texts[i] for i in pool], [full.label_names.index(full.labels[i]) for i in pool]
    t = time.perf_counter()
    tokens = dd.site_tokens(lens, tok, SITE, texts, labels, 64)
    print(f"{len(pool)} pool articles read in {time.perf_counter() - t:.0f} s", flush=True)
    more = [text for name in args.fit_sets for text in data.load(name, "train").texts]
    fitted = fit_texts(full.texts, set(texts), more, args.seed)

    cands = []
    for k, mult in zip(args.ks, args.lr_mults):
        options = {"width": 2048, "k": k, "lr_mult": mult}
        if args.batch_size is not None:
            lr = mult * short_budget_lr(2048, args.steps_for_lr, args.batch_size)
            options = {"width": 2048, "k": k, "spec": {"batch_size": args.batch_size, "lr": lr}}
        cands.append(dd.Candidate(f"topk_w2048_k{k}_lr{mult:g}x", SITE, "topk", options))
    t = time.perf_counter()
    report = lens.fit(dd.fit_plan(cands, args.seed, args.max_tokens), fitted, max_tokens=args.max_tokens,
                      max_length=args.fit_length, batch_size=args.fit_batch, progress=False)
    print(f"fit: {report.tokens:,} tokens of {report.documents:,} documents in {time.perf_counter() - t:.0f} s",
          flush=True)
    probed = dd.read(tokens, {c.name: report.concepts[c.name] for c in cands}, 20, args.seed)
    records = dd.validate(probed, full.label_names, 3, args.seed)
    print(f"{'SAE':<22} {'steps':>6} {'fit FVU':>8} {'wins':>6} {'margin':>7} {'k=5 acc':>8}")
    for c in cands:
        rows = [r for r in records if r["set"] == c.name]
        stats = report.stats[c.name]
        print(f"{c.name:<22} {stats.steps:>6} {stats.last.fvu:8.3f} {sum(r['win'] for r in rows):>3}/{len(rows)} "
              f"{statistics.mean(r['value'] - r['control'] for r in rows):+7.3f} "
              f"{statistics.mean(r['value'] for r in rows):8.3f}")


if __name__ == "__main__":
    main()
