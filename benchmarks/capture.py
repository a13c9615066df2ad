"""Capture overhead on SmolLM2, side by side in one run, as ratios to the bare forward.

    python benchmarks/capture.py [--batch 8] [--length 128] [--rounds 7]

Rows: bare forward; full forward capturing every `blocks.{i}.resid_out` (30 sites,
padding dropped); capture-only forward of `blocks.2.resid_out` (stops after block 2).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved, print_table  # noqa: E402

import conceptlens  # noqa: E402
from conceptlens import data, models  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    model, tok = models.load("smollm2-135m")
    texts = data.load("bbc-news", split="train").texts[: args.batch]
    batch = tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=args.length)
    tokens = int(batch["attention_mask"].sum())
    lens = conceptlens.attach(model, tok)
    resid = [f"blocks.{i}.resid_out" for i in range(lens.adapter.n_blocks[""])]
    all_resid = lens.capture(resid, on_batch=lambda acts, meta: None)
    early = lens.capture("blocks.2.resid_out", on_batch=lambda acts, meta: None)

    def bare():
        model(**batch)

    def capture_all():
        with all_resid:
            model(**batch)

    def stop_early():
        with early:
            early.forward(**batch)

    with torch.inference_mode():
        seconds = interleaved({"bare forward": bare, f"capture all {len(resid)} resid_out": capture_all,
                               "capture-only blocks.2.resid_out": stop_early}, rounds=args.rounds)
    print(f"SmolLM2-135M fp32, batch {args.batch} x <= {args.length} tokens ({tokens} real), "
          f"{torch.get_num_threads()} threads")
    print_table("forward time (median of interleaved rounds)", seconds, "bare forward", tokens)


if __name__ == "__main__":
    main()
