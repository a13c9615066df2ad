"""Held-out FVU of our SAEs by token budget and learning rate: what `short_budget_lr` rests on.

    python benchmarks/peers_rows.py      # once: ~1.07M rows of every bundled set's train split
    python benchmarks/lr_budget.py [--arch topk] [--batch 4096] [--mults 1,3,10,30] \\
        [--budgets 61440,245760,1024000] [--decay 0.2] [--width 2304] [--k 32] [--threads 2]

Rows: `peers_rows.py`'s capture (SmolLM2 blocks.15.resid_out over the bundled train sets). The
last shard is held out (FVU on `--held-out` rows of it, drawn with seed 0); training reads the
shards before it, shuffled with seed 0, one optimiser step per `--batch` rows, every row distinct.
Each multiplier is `--mults` times the library default lr (Gao et al.: 2e-4 sqrt(16384 / width)).
At a constant lr a budget's fit is the prefix of the longest one (same rows, same order), so one
pass per multiplier gives every budget: the SAEs step interleaved (multiplier A, B, C on batch 1,
then on batch 2, ...) in one process, so machine load hits all alike. `--decay F` instead fits
each (budget, multiplier) on its own, the lr falling linearly over the last F of the budget's
steps (to 1/(F steps) of it at the last step). Prints FVU per multiplier x budget (the best of
each budget starred) and `uptime`.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import time
from pathlib import Path

import torch
from torch import Tensor

from _peers import Ours, default_lr, fvu
from peers_rows import CACHE


def rows(cache: Path, window: int, train: int, held_out: int) -> tuple[Tensor, Tensor]:
    """`train` shuffled rows from the capture's first shards and `held_out` rows of its last one."""
    parts = sorted((cache / f"train-{window}").glob("shard-*.pt"))
    if len(parts) < 2:
        raise FileNotFoundError(f"need at least 2 shards in {cache / f'train-{window}'}; run peers_rows.py")
    last = torch.load(parts[-1], weights_only=True)
    test = last[torch.randperm(len(last), generator=torch.Generator().manual_seed(0))[:held_out]].float()
    loaded, n = [], 0
    for p in parts[:-1]:  # each shard holds whole documents drawn at random: a prefix of shards is a fair sample
        loaded.append(torch.load(p, weights_only=True))
        n += len(loaded[-1])
        if n >= train:
            break
    if n < train:
        raise ValueError(f"--budgets asks for {train} training rows; the shards before the last hold {n}")
    x = torch.cat(loaded)
    return x[torch.randperm(n, generator=torch.Generator().manual_seed(0))[:train]].contiguous(), test


def sae_class(arch: str) -> type:
    from conceptlens.concepts.sae import BatchTopKSAE, JumpReLUSAE, TopKSAE

    return {"topk": TopKSAE, "batchtopk": BatchTopKSAE, "jumprelu": JumpReLUSAE}[arch]


def decay_factor(step: int, steps: int, decay_from: int | None) -> float:
    """The lr multiplier of 0-based `step` of `steps`: 1, then from `decay_from` falling linearly
    (steps - step) / (steps - decay_from), so the last step takes 1 / (steps - decay_from) of the lr."""
    return 1.0 if decay_from is None or step < decay_from else (steps - step) / (steps - decay_from)


def fit(cls: type, mults: list[float], train: Tensor, test: Tensor, batch: int, width: int, k: int,
        evals: list[int], decay_from: int | None = None) -> tuple[dict[float, list[float]], dict[float, float]]:
    """Step one SAE per multiplier on the same batches, interleaved; FVU on `test` after each of
    the step counts `evals`. From step `decay_from` the lr falls linearly (see `decay_factor`)."""
    base = default_lr(cls, width)
    saes = {m: Ours(cls, train.shape[1], width, k, batch, lr=m * base) for m in mults}
    curves: dict[float, list[float]] = {m: [] for m in mults}
    seconds = dict.fromkeys(mults, 0.0)
    steps = max(evals)
    for step in range(steps):
        x = train[step * batch:(step + 1) * batch].float()
        for m, sae in saes.items():
            optimizer = sae.sae.trainer.optimizer  # made at the first step
            if optimizer is not None:
                for group in optimizer.param_groups:
                    group["lr"] = m * base * decay_factor(step, steps, decay_from)
            start = time.perf_counter()
            sae.step(x)
            seconds[m] += time.perf_counter() - start
        if step + 1 in evals:
            for m, sae in saes.items():
                curves[m].append(fvu(test, sae.reconstruct(test)))
            print(f"  {(step + 1) * batch} tokens: " + ", ".join(f"{m:g}x {c[-1]:.4f}" for m, c in curves.items()),
                  flush=True)
    return curves, seconds


def table(title: str, budgets: list[int], batch: int, curves: dict[float, list[float]], base: float) -> str:
    best = [min(c[i] for c in curves.values()) for i in range(len(budgets))]
    head = " ".join(f"{f'{b:,} ({b // batch})':>17s}" for b in budgets)
    lines = [title, f"{'lr (x default)':<22s} {head}"]
    for m, c in curves.items():
        cells = " ".join(f"{v:16.4f}{'*' if v == b else ' '}" for v, b in zip(c, best))
        lines.append(f"{f'{m:g}x ({m * base:.2e})':<22s} {cells}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=("topk", "batchtopk", "jumprelu"), default="topk")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--mults", default="1,3,10,30", help="multiples of the default lr")
    parser.add_argument("--budgets", default="61440,245760,1024000", help="training tokens (whole batches)")
    parser.add_argument("--decay", type=float, default=0.0,
                        help="fit each budget on its own, the lr falling linearly over this last fraction")
    parser.add_argument("--width", type=int, default=4 * 576)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--held-out", type=int, default=4096, help="FVU rows from the capture's last shard")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    mults = [float(m) for m in args.mults.split(",")]
    budgets = sorted(int(b) for b in args.budgets.split(","))
    if not 0 <= args.decay < 1 or any(b < args.batch for b in budgets):
        parser.error(f"--decay must be in [0, 1) and every budget at least --batch {args.batch}")
    torch.set_num_threads(args.threads)
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # a process's first optimiser imports torch._dynamo
    train, test = rows(args.cache, args.window, budgets[-1] // args.batch * args.batch, args.held_out)
    cls, evals = sae_class(args.arch), [b // args.batch for b in budgets]
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"{args.arch}, width {args.width}, k {args.k}, batch {args.batch}, {len(train)} train rows, "
          f"{len(test)} held out, {args.threads} threads; load before: {load}", flush=True)
    if args.decay:
        curves: dict[float, list[float]] = {m: [] for m in mults}
        seconds: dict[float, float] = dict.fromkeys(mults, 0.0)
        for steps in evals:
            c, s = fit(cls, mults, train, test, args.batch, args.width, args.k, [steps],
                       decay_from=math.floor(steps * (1 - args.decay)))
            for m in mults:
                curves[m] += c[m]
                seconds[m] += s[m]
    else:
        curves, seconds = fit(cls, mults, train, test, args.batch, args.width, args.k, evals)
    print(f"load after: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    schedule = f"lr decayed linearly over the last {args.decay:g}" if args.decay else "constant lr"
    title = (f"\nheld-out FVU, {args.arch} width {args.width} k {args.k}, batch {args.batch}, {schedule}; "
             f"columns: budget tokens (steps)")
    print(table(title, budgets, args.batch, curves, default_lr(cls, args.width)))
    print("step seconds: " + ", ".join(f"{m:g}x {s:.0f}" for m, s in seconds.items()))


if __name__ == "__main__":
    main()
