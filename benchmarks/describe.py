"""The description pass vs a bare forward over the same documents, side by side in one run.

    python benchmarks/describe.py [--docs 48] [--batch 16] [--length 128] [--rounds 3] [--width 4608] [--device cpu]

SmolLM2-135M, BBC News articles spread over the five topics. Rows: the bare model forward
(tokenising included, LM head included) over every batch; the capture-only forward to
blocks.15.resid_out that the pass runs; and `lens.describe` of three sets at that site in one
pass (a TopK SAE of `--width` latents, k-means and Deleuzian-style directions of 512 each;
weights random: the cost does not depend on them), with top-16 windows, histograms,
co-activation, promoted tokens and the finishing step. Prints each as a ratio to the bare
forward, and the finishing step (neighbours, logit tokens, decoding; once per pass) apart.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved, print_table  # noqa: E402

import conceptlens  # noqa: E402
from conceptlens import ConceptSet, data, models  # noqa: E402
from conceptlens.batching import encode_batch  # noqa: E402
from conceptlens.describe import run as describe_run  # noqa: E402

SITE = "blocks.15.resid_out"


def concept_sets(d: int, width: int, device: str) -> dict[str, ConceptSet]:
    from conceptlens.concepts.sae import TopKSAE

    g = torch.Generator().manual_seed(0)
    sae = TopKSAE(width=width, k=32, batch_size=256, warmup_tokens=256, seed=0)
    sae.update(torch.randn(512, d, generator=g) * 10)
    sae.flush()
    topk = sae.concept_set()
    topk.site = SITE
    return {"topk": topk,
            "kmeans": ConceptSet(torch.randn(512, d, generator=g) * 10, SITE, method="kmeans"),
            "deleuzian": ConceptSet(torch.randn(512, d, generator=g), SITE, method="deleuzian")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=48)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=4608)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    model, tok = models.load("smollm2-135m")
    model.to(args.device)
    texts = data.load("bbc-news", split="all").texts
    texts = texts[:: max(1, len(texts) // args.docs)][: args.docs]
    lens = conceptlens.attach(model, tok)
    sets = concept_sets(model.config.hidden_size, args.width, args.device)
    tokens = sum(int(encode_batch(tok, texts[i:i + args.batch], args.length)["attention_mask"].sum())
                 for i in range(0, len(texts), args.batch))
    finishing: list[float] = []
    plain_finish = describe_run.finish

    def timed_finish(*a, **kw):
        start = time.perf_counter()
        out = plain_finish(*a, **kw)
        finishing.append(time.perf_counter() - start)
        return out

    describe_run.finish = timed_finish
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def batches():
        for i in range(0, len(texts), args.batch):
            yield {k: v.to(args.device) for k, v in encode_batch(tok, texts[i:i + args.batch], args.length).items()}

    def bare():
        for batch in batches():
            model(**batch)
        sync()

    def to_site():
        with lens.capture(SITE) as cap:
            for batch in batches():
                cap.forward(**batch)
        sync()

    def describe():
        lens.describe(sets, texts, batch_size=args.batch, max_length=args.length, progress=False)
        sync()

    with torch.inference_mode():
        seconds = interleaved({"bare forward (full model)": bare, f"capture-only forward to {SITE}": to_site,
                               "describe 3 sets (one pass + finish)": describe}, rounds=args.rounds)
    n_finish = len(sets) * (args.rounds + 1)
    finish_s = sorted(finishing)[len(finishing) // 2] * len(sets) if finishing else 0.0
    seconds["describe, streaming part only"] = seconds["describe 3 sets (one pass + finish)"] - finish_s
    print(f"SmolLM2-135M fp32 on {args.device}, {len(texts)} documents x <= {args.length} tokens ({tokens} real), "
          f"batch {args.batch}, {torch.get_num_threads()} threads; sets: TopK SAE {args.width}, k-means 512, "
          f"Deleuzian 512 ({n_finish} finishing steps timed)")
    print_table("time over the same documents (median of interleaved rounds)", seconds,
                "bare forward (full model)", tokens)
    ratio = seconds["describe 3 sets (one pass + finish)"] / seconds["bare forward (full model)"]
    print(f"\ndescription pass / bare forward: {ratio:.3f}x (target <= 1.15x); finishing step "
          f"{finish_s * 1e3:.0f} ms per pass (3 sets)")


if __name__ == "__main__":
    main()
