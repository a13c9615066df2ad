"""Why a peer wins: our TopK SAE and sparsify's with one hyper-parameter changed at a time.

    python benchmarks/peers_ablate.py [--tokens 49152] [--epochs 1] [--width 2304] [--k 32] [--variants a,b]

Same rows, batches and interleaved timing as `peers.py` (FVU only, no CE). Variants: ours
at its default Adam lr (2e-4 sqrt(16384 / width)) and at 4x / 10x / 25x it, ours with a mean
b_dec, ours at 10x lr with the encoder started at sparsify's scale (1/sqrt(3) of the
decoder's); sparsify at its default (schedule-free SignSGD), evaluated at its training weights
instead of the schedule-free average, and with plain Adam at our default lr and at 10x it.
"""

from __future__ import annotations

import argparse
import math
import subprocess

import torch

from _peers import Ours, Sparsify, Trainer
from peers import compare


def variants(d: int, width: int, k: int, batch: int) -> dict[str, object]:
    from conceptlens.concepts.sae import TopKSAE

    class SmallEncoderTopK(TopKSAE):
        """Encoder rows started at sparsify's scale: nn.Linear's U(+-1/sqrt(d)) rows have norm ~1/sqrt(3)."""

        def _init_params(self, x):  # type: ignore[no-untyped-def]
            params = super()._init_params(x)
            params["W_enc"] = params["W_enc"] / 3 ** 0.5
            return params

    lr = 2e-4 * math.sqrt(16384 / width)

    def sparsify(adam_lr: float | None = None, average: bool = True) -> Trainer:
        s = Sparsify(d, width, k, batch, adam_lr=adam_lr)
        s.average = average
        return s

    return {
        "ours": lambda: Ours(TopKSAE, d, width, k, batch),
        "ours-lr4x": lambda: Ours(TopKSAE, d, width, k, batch, lr=4 * lr),
        "ours-lr10x": lambda: Ours(TopKSAE, d, width, k, batch, lr=10 * lr),
        "ours-lr25x": lambda: Ours(TopKSAE, d, width, k, batch, lr=25 * lr),
        "ours-lr10x-small-enc": lambda: Ours(SmallEncoderTopK, d, width, k, batch, lr=10 * lr),
        "ours-mean-bdec": lambda: Ours(TopKSAE, d, width, k, batch, b_dec_init="mean"),
        "sparsify": lambda: sparsify(),
        "sparsify-no-average": lambda: sparsify(average=False),
        "sparsify-adam": lambda: sparsify(adam_lr=lr),
        "sparsify-adam10x": lambda: sparsify(adam_lr=10 * lr),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", choices=("bbc", "peers"), default="bbc",
                        help="bbc: the 49k cached bbc-news train rows; peers: peers_rows.py's capture")
    parser.add_argument("--tokens", type=int, default=49152)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--width", type=int, default=4 * 576)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--evals", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variants", default="ours,ours-lr4x,ours-lr10x,ours-lr25x,ours-mean-bdec,sparsify,"
                                              "sparsify-no-average,sparsify-adam")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from _rows import block15_rows

    if args.rows == "bbc":
        rows = block15_rows(49152, split="train")[:args.tokens]
    else:
        from peers_rows import load_rows
        rows = load_rows(limit=args.tokens, complete=False).float()
    train = torch.cat([rows] + [rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(e))]
                                for e in range(1, args.epochs)])
    held_out = block15_rows(16384, split="test")[:4096]
    every = variants(train.shape[1], args.width, args.k, args.batch)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in every]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {', '.join(every)}")
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"{train.shape[0]} rows seen ({rows.shape[0]} distinct), width {args.width}, k {args.k}, "
          f"batch {args.batch}, {args.threads} threads; load: {load}", flush=True)
    curves = compare({n: every[n]() for n in names}, train, held_out, args.batch, args.evals)
    print(f"\n{'variant':<22s} " + " ".join(f"{p.tokens:>8d}" for p in next(iter(curves.values()))) + "   step s")
    for name, curve in curves.items():
        print(f"{name:<22s} " + " ".join(f"{p.fvu:8.4f}" for p in curve) + f"   {curve[-1].seconds:6.1f}")


if __name__ == "__main__":
    main()
