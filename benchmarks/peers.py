"""Our TopK, BatchTopK and JumpReLU SAEs side by side with SAELens's and sparsify's trainers.

    python benchmarks/peers_rows.py      # once: ~1.07M rows of every bundled set's train split
    python benchmarks/peers.py [--quick] [--rows peers|bbc] [--tokens N] [--width 2304] [--k 32] [--png PATH] [--json RUN/peers.json]

Every trainer gets the same rows in the same order: SmolLM2-135M blocks.15.resid_out over the
train splits of the four bundled text sets (`--rows peers`, captured once by `peers_rows.py`) or
49k rows of bbc-news's (`--rows bbc`, `_rows.py`), one optimiser step per
`--batch` rows, each with its own recommended hyper-parameters (see `_peers.py`). Steps are
interleaved (trainer A, B, C on batch 1, then on batch 2, ...) in one process with one thread
count, so machine load hits all alike; only the steps are timed. At `--evals` points each
trainer's FVU is measured on held-out rows (bbc-news test split) and, at the last `--ce-evals`
of them, CE-loss recovered: its reconstruction spliced into SmolLM2 at blocks.15.resid_out on
held-out test documents, against the clean and zero-ablated losses. Prints the curves, a table
(final figures, step tokens/s, and whether ours reaches each peer's final FVU / CE-loss recovered
in no more tokens and at most 0.7x its wall time) and writes a PNG of the curves; `--json` also
writes the final figures and verdicts as `peers.json`, which the atlas of the run folder holding
it shows beside the evaluation suite's table.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import time
from pathlib import Path
from typing import Callable, Mapping, NamedTuple

import torch
from torch import Tensor

from _peers import Trainer, fvu, l0, makers

SITE = "blocks.15.resid_out"
CAPTURED = 49152  # train-split rows captured once; --tokens takes a prefix of them (they come shuffled)


class Point(NamedTuple):
    tokens: int
    seconds: float  # step time so far (evaluation not counted)
    fvu: float
    l0: float
    ce_recovered: float  # nan where CE was not measured
    first_step: float = math.nan  # seconds of the first step, which holds each trainer's initialisation


def compare(trainers: Mapping[str, Trainer], train: Tensor, held_out: Tensor, batch: int, evals: int,
            ce: Callable[[Trainer], float] | None = None, ce_evals: int = 0) -> dict[str, list[Point]]:
    """Step every trainer on the same `batch`-row slices of `train`, interleaved; evaluate at
    `evals` evenly spaced points (CE at the last `ce_evals` of them). Returns each one's curve."""
    n_steps = train.shape[0] // batch
    # a process's first torch.optim optimiser imports torch._dynamo (3-30 s here): pay it before timing
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])
    at = sorted({max(1, round(n_steps * (i + 1) / evals)) for i in range(evals)})
    seconds = dict.fromkeys(trainers, 0.0)
    first = dict.fromkeys(trainers, 0.0)
    curves: dict[str, list[Point]] = {name: [] for name in trainers}
    for step in range(n_steps):
        rows = train[step * batch:(step + 1) * batch].float()
        for name, trainer in trainers.items():
            start = time.perf_counter()
            trainer.step(rows)
            seconds[name] += time.perf_counter() - start
            first[name] = first[name] or seconds[name]
        if step + 1 in at:
            with_ce = ce is not None and at.index(step + 1) >= len(at) - ce_evals
            for name, trainer in trainers.items():
                recovered = ce(trainer) if with_ce else math.nan
                curves[name].append(Point((step + 1) * batch, seconds[name], fvu(held_out, trainer.reconstruct(held_out)),
                                          l0(trainer, held_out), recovered, first[name]))
            print(f"  {(step + 1) * batch} tokens: " + ", ".join(f"{n} {c[-1].fvu:.3f}" for n, c in curves.items()),
                  flush=True)
    return curves


def ce_evaluator(n_docs: int, max_length: int) -> Callable[[Trainer], float]:
    """CE-loss recovered at SITE on `n_docs` bbc-news test documents no FVU row came from."""
    import conceptlens
    from conceptlens import data, models
    from conceptlens.metrics.faithfulness import next_token_loss_sum
    from conceptlens.metrics.splice import splice_ce, splice_mask

    texts = [t for i, t in enumerate(data.load("bbc-news", split="test").texts) if i % 7][-n_docs:]
    model, tok = models.load("smollm2-135m")
    lens = conceptlens.attach(model, tok)
    docs = dict(tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=max_length))
    base = splice_ce(lens, SITE, lambda x: x, docs)  # identity: spliced == clean, and the clean / zero losses
    where = splice_mask(docs["attention_mask"])

    @torch.no_grad()
    def recovered(trainer: Trainer) -> float:
        def replace(x: Tensor) -> Tensor:
            out = x.clone()
            out[where] = trainer.reconstruct(x[where].float()).to(x.dtype)
            return out

        with lens.hook(SITE, replace):
            total, n = next_token_loss_sum(lens.model(**docs).logits, docs["input_ids"], docs["attention_mask"])
        return (base.zero_ablated - total / n) / (base.zero_ablated - base.clean)

    print(f"CE docs: {len(texts)} test articles, {base.tokens} predicted tokens; clean {base.clean:.3f} nats, "
          f"zero-ablated {base.zero_ablated:.3f}, identity splice {base.spliced:.3f}")
    return recovered


def first_reach(curve: list[Point], field: str, target: float, lower: bool) -> Point | None:
    """The first point whose `field` is at least as good as `target` (lower or higher is better)."""
    for p in curve:
        value = getattr(p, field)
        if not math.isnan(value) and (value <= target if lower else value >= target):
            return p
    return None


def goal_rows(curves: dict[str, list[Point]]) -> list[str]:
    """For each (ours, peer): tokens and wall-time ratios at which ours first reaches the peer's final figure."""
    lines = []
    for peer, pc in curves.items():
        if peer.startswith("ours"):
            continue
        for ours, oc in curves.items():
            if not ours.startswith("ours"):
                continue
            for field, lower in (("fvu", True), ("ce_recovered", False)):
                target = getattr(pc[-1], field)
                if math.isnan(target):
                    continue
                p = first_reach(oc, field, target, lower)
                if p is None:
                    lines.append(f"  {ours:<15s} vs {peer:<18s} {field:<13s} {target:8.4f}  not reached  -> peer wins")
                    continue
                tok, wall = p.tokens / pc[-1].tokens, p.seconds / pc[-1].seconds
                verdict = "goal met" if tok <= 1 and wall <= 0.7 else "goal missed"
                if not p.l0 <= 1.5 * pc[-1].l0:  # a denser code is not a like-for-like win
                    verdict += f" (but L0 {p.l0:.0f} vs {pc[-1].l0:.0f}: not comparable)"
                lines.append(f"  {ours:<15s} vs {peer:<18s} {field:<13s} {target:8.4f}  tokens {tok:5.2f}x  "
                             f"wall {wall:5.2f}x  -> {verdict}")
    return lines


def report(curves: dict[str, list[Point]], batch: int) -> None:
    print(f"\n{'trainer':<18s} {'tokens':>8s} {'step s':>8s} {'FVU':>7s} {'L0':>7s} {'CE rec':>7s}")
    for name, curve in curves.items():
        for p in curve:
            print(f"{name:<18s} {p.tokens:8d} {p.seconds:8.1f} {p.fvu:7.4f} {p.l0:7.1f} {p.ce_recovered:7.3f}")
    print(f"\n{'final':<18s} {'tokens':>8s} {'step s':>8s} {'1st s':>6s} {'tok/s':>6s} {'later':>6s} "
          f"{'FVU':>7s} {'L0':>7s} {'CE rec':>7s}   (tok/s: all steps; later: after the first)")
    for name, curve in curves.items():
        p = curve[-1]
        later = (p.tokens - batch) / (p.seconds - p.first_step) if p.seconds > p.first_step else math.nan
        print(f"{name:<18s} {p.tokens:8d} {p.seconds:8.1f} {p.first_step:6.1f} {p.tokens / p.seconds:6.0f} "
              f"{later:6.0f} {p.fvu:7.4f} {p.l0:7.1f} {p.ce_recovered:7.3f}")
    print("\nours reaching each peer's final figure (goal: tokens <= 1x and wall <= 0.7x):")
    print("\n".join(goal_rows(curves)) or "  (no peer installed)")


def write_json(curves: dict[str, list[Point]], path: Path, setup: str) -> None:
    """The final figures and the goal verdicts as `conceptlens.Peers` JSON (NaN written as null), for the atlas."""
    import json

    def clean(v: float) -> float | None:
        return None if math.isnan(v) else round(float(v), 6)

    final = {name: {"tokens": c[-1].tokens, "seconds": clean(c[-1].seconds), "fvu": clean(c[-1].fvu),
                    "l0": clean(c[-1].l0), "ce_recovered": clean(c[-1].ce_recovered)} for name, c in curves.items()}
    data = {"format": "conceptlens.Peers", "version": 1, "model": "smollm2-135m", "site": SITE, "setup": setup,
            "final": final, "goals": goal_rows(curves)}
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")
    print(f"wrote {path}")


def plot(curves: dict[str, list[Point]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(9, 6.5), sharey="row")
    for name, curve in curves.items():
        style = "-" if name.startswith("ours") else "--"
        for row, field in enumerate(("fvu", "ce_recovered")):
            pts = [p for p in curve if not math.isnan(getattr(p, field))]
            for col, x in enumerate(("tokens", "seconds")):
                axes[row, col].plot([getattr(p, x) for p in pts], [getattr(p, field) for p in pts], style,
                                    marker="o", ms=3, label=name)
    for col, x in enumerate(("tokens seen", "step wall time (s)")):
        axes[1, col].set_xlabel(x)
    axes[0, 0].set_ylabel("held-out FVU")
    axes[1, 0].set_ylabel("CE-loss recovered")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a first pass")
    parser.add_argument("--rows", choices=("peers", "bbc"), default="peers",
                        help="peers: every bundled set's train split, ~1.07M rows (peers_rows.py captures them once); "
                             f"bbc: {CAPTURED} bbc-news train rows")
    parser.add_argument("--tokens", type=int, help="training rows (a prefix of the shuffled capture; default all)")
    parser.add_argument("--partial", action="store_true", help="take a --rows peers capture still under way")
    parser.add_argument("--epochs", type=int, default=1,
                        help="passes over the training rows, each in a new seeded order (tokens then count rows seen)")
    parser.add_argument("--held-out", type=int, default=4096, help="FVU rows (bbc-news test split)")
    parser.add_argument("--width", type=int, default=4 * 576)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--evals", type=int, default=6)
    parser.add_argument("--ce-evals", type=int, default=2, help="CE-loss recovered at the last N eval points")
    parser.add_argument("--ce-docs", type=int, default=8)
    parser.add_argument("--ce-length", type=int, default=128)
    parser.add_argument("--trainers", default="ours-topk,ours-batchtopk,ours-jumprelu,saelens-topk,sparsify-topk")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--png", type=Path, default=Path("benchmarks/peers.png"))
    parser.add_argument("--json", type=Path, help="also write the final figures here (RUN/peers.json: the atlas shows them)")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.tokens, args.held_out, args.width, args.batch, args.evals, args.ce_docs = "bbc", 8192, 2048, 1152, 1024, 4, 4
    torch.set_num_threads(args.threads)
    from _rows import block15_rows

    if args.rows == "bbc" and (args.tokens or 0) > CAPTURED:
        parser.error(f"--tokens must be at most {CAPTURED} (the rows captured); got {args.tokens}")
    if args.epochs < 1:
        parser.error(f"--epochs must be a positive integer; got {args.epochs}")
    if args.rows == "bbc":
        rows = block15_rows(CAPTURED, split="train")[:args.tokens]
    else:
        from peers_rows import load_rows
        rows = load_rows(limit=args.tokens, complete=not args.partial)  # float16; each batch becomes float32
    train = torch.cat([rows] + [rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(e))]
                                for e in range(1, args.epochs)])
    held_out = block15_rows(16384, split="test")[:args.held_out]
    available = makers(train.shape[1], args.width, args.k, args.batch, steps=train.shape[0] // args.batch)
    names = args.trainers.split(",")
    missing = [n for n in names if n not in available]
    if missing:
        print(f"not available here (peer not installed or unknown): {missing}; available: {sorted(available)}")
    trainers = {n: available[n]() for n in names if n in available}
    ce = ce_evaluator(args.ce_docs, args.ce_length) if args.ce_evals else None
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"{SITE} rows: {train.shape[0]} train, {held_out.shape[0]} held out; width {args.width}, k {args.k}, "
          f"batch {args.batch}, {torch.get_num_threads()} threads; load before: {load}")
    curves = compare(trainers, train, held_out, args.batch, args.evals, ce, args.ce_evals)
    print(f"load after: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    report(curves, args.batch)
    passes = f" ({args.epochs} passes over {rows.shape[0]})" if args.epochs > 1 else ""
    text = "bbc-news" if args.rows == "bbc" else "bundled-text"
    setup = f"{train.shape[0]} {text} tokens{passes}, width {args.width}, k {args.k}, batch {args.batch}"
    plot(curves, args.png, f"SmolLM2 {SITE}, {setup}")
    if args.json:
        write_json(curves, args.json, setup)


if __name__ == "__main__":
    main()
