"""1-, 2- and 4-process fit throughput on CPU (gloo), the cost of the collectives, memory per rank.

    python benchmarks/distributed.py            # the full run (3 interleaved rounds, a few minutes idle)
    python benchmarks/distributed.py --quick    # one round of a smaller fit: < 5 minutes on 2 idle cores
    python benchmarks/distributed.py --tiny     # 1 and 2 processes on 16 documents (the test suite runs it)

A random 4-block Llama (hidden 128 by default), 400 synthetic documents of <= 64 tokens,
one k-means (`--centres`), one TopK SAE (width 32 * hidden) and one VQ codebook (`--centres`
codes, batch 512) at three sites, unsharded (each dictionary updated on one rank, and every
rank holds it whole at the end) and sharded (`ShardedKMeans`, `ShardedTopKSAE`, `ShardedVQ`:
each rank updates and holds 1/W of each). The same documents on each world size (each rank
with 1 thread); per rank we time the fit, and, by wrapping the communicator, the seconds spent
in all-reduces and in every collective and their number. Tokens/s is the global token count
over the slowest rank's fit time. Memory per rank: the bytes of the extractors' states
(parameters, Adam moments, counts, buffered rows) and the process's peak resident set. The
table puts each figure next to its baseline: tokens/s against 1 unsharded process, memory
against the unsharded fit on as many processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests import distributed_workers as W  # noqa: E402


def _state_bytes(state) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(v) for v in state)
    return 0


def _body(comm, out: Path, docs: int, hidden: int, centres: int = 32, sharded: bool = False) -> dict:
    import resource

    import transformers as tf

    from conceptlens.concepts.sae.sharded import ShardedTopKSAE
    from conceptlens.concepts.sharded import ShardedKMeans

    import conceptlens
    from conceptlens import distributed
    from conceptlens.concepts import ShardedVQ, StreamingKMeans, TopKSAE, VQCodebook
    from conceptlens.filters import FilterConfig
    from tests.conftest import CharTokenizer

    spent = {"seconds": 0.0, "calls": 0, "allreduce_seconds": 0.0, "depth": 0}
    for name in ("sum_", "max_", "gather_rows", "broadcast_", "gather_objects", "gather_objects_on", "broadcast_object"):
        inner = getattr(distributed.Comm, name)

        def timed(self, *args, _inner=inner, _name=name, **kwargs):
            start = time.perf_counter()
            spent["depth"] += 1
            try:
                return _inner(self, *args, **kwargs)
            finally:
                seconds = time.perf_counter() - start
                spent["depth"] -= 1
                if spent["depth"] == 0:  # outermost (gather_rows may all-reduce the sizes first)
                    spent["seconds"] += seconds
                    spent["calls"] += 1
                if _name in ("sum_", "max_"):
                    spent["allreduce_seconds"] += seconds
        setattr(distributed.Comm, name, timed)
    torch.manual_seed(0)
    config = tf.LlamaConfig(num_hidden_layers=4, hidden_size=hidden, intermediate_size=4 * hidden,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=99, max_position_embeddings=128)
    lens = conceptlens.attach(tf.AutoModelForCausalLM.from_config(config).eval(), CharTokenizer())
    corpus = [f"doc {i} " + "the quick brown fox jumps over a lazy dog "[i % 9:] * 2 for i in range(docs)]
    kmeans, sae, vq = (ShardedKMeans, ShardedTopKSAE, ShardedVQ) if sharded else (StreamingKMeans, TopKSAE, VQCodebook)
    extractors = {"blocks.2.resid_out": kmeans(centres, init_size=max(512, centres), seed=0),
                  "blocks.1.resid_out": sae(width=32 * hidden, k=16, batch_size=512, warmup_tokens=512, seed=0),
                  "blocks.3.resid_out": vq(centres, init_size=2 * centres, batch_size=512, seed=0)}
    start = time.perf_counter()
    report = lens.fit(extractors, corpus, batch_size=8, max_length=64, progress=False,
                      filters=FilterConfig(max_norm_ratio=None), distributed=True)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": report.tokens, "batches": report.batches,
            "sae_steps": extractors["blocks.1.resid_out"].stats().steps, "comm": spent,
            "state_mib": round(sum(_state_bytes(e.state_dict()) for e in extractors.values()) / 2**20, 2),
            "state_mib_by_site": {k: round(_state_bytes(e.state_dict()) / 2**20, 3) for k, e in extractors.items()},
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def _allreduce_body(comm, out: Path, sizes: list[int], repeats: int) -> dict:
    """Median milliseconds of one float64 all-reduce of each size (elements), after a warm-up."""
    result = {}
    for n in sizes:
        t = torch.randn(n, dtype=torch.float64)
        times = []
        for i in range(repeats + 3):
            comm.barrier()  # both ranks start together: the time is the transfer, not a wait
            start = time.perf_counter()
            comm.sum_(t)
            if i >= 3:
                times.append(time.perf_counter() - start)
        result[n] = round(1000 * statistics.median(times), 3)
    return result


PRESETS = {"quick": dict(docs=96, hidden=64, centres=256, rounds=1, skip_allreduce=True),
           "tiny": dict(docs=16, hidden=32, centres=16, rounds=1, worlds=[1, 2], skip_allreduce=True)}
"""Smaller runs: --quick (< 5 minutes on 2 idle cores), --tiny (the test suite's; without 1 sharded process,
which is the unsharded one)."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=400)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the world sizes (medians)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--centres", type=int, default=1024)
    parser.add_argument("--allreduce-only", action="store_true", help="only time bare all-reduces")
    parser.add_argument("--skip-allreduce", action="store_true")
    parser.add_argument("--quick", action="store_true", help=f"preset {PRESETS['quick']}")
    parser.add_argument("--tiny", action="store_true", help=f"preset {PRESETS['tiny']}")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args(argv)
    for name in ("quick", "tiny"):
        if getattr(args, name):
            vars(args).update(PRESETS[name])
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}, {args.docs} documents, hidden "
          f"{args.hidden}, {args.centres} centres, {args.rounds} round(s)")
    if not args.skip_allreduce:
        _allreduce_table(args.hidden)
    if args.allreduce_only:
        return
    runs: dict[tuple[int, bool], list[dict]] = {(w, s): [] for w in args.worlds for s in (False, True)
                                                if not (args.tiny and w == 1 and s)}  # (1 sharded = unsharded)
    for _ in range(args.rounds):  # interleaved, so a change of machine load hits every world size alike
        for world, sharded in runs:
            codes, results, _ = W.spawn(_body, world, Path(f"/tmp/conceptlens_bench_dist{world}"), args.docs,
                                        args.hidden, args.centres, sharded, timeout=1200, collective_timeout=300)
            if codes != [0] * world:
                raise SystemExit(f"world {world} failed: {results}")
            runs[world, sharded].append({"seconds": max(r["seconds"] for r in results), **results[0],
                                         "state_mib_ranks": [r["state_mib"] for r in results],
                                         "peak_rss_mib_ranks": [r["peak_rss_mib"] for r in results]})
    rows = {f"{world} rank(s){' sharded' if sharded else ''}": _row(world, sharded, done)
            for (world, sharded), done in runs.items()}
    print(_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


def _row(world: int, sharded: bool, done: list[dict]) -> dict:
    seconds = statistics.median(r["seconds"] for r in done)
    spent = statistics.median(r["comm"]["seconds"] for r in done)
    reduce = statistics.median(r["comm"]["allreduce_seconds"] for r in done)
    steps = max(done[0]["batches"], 1)
    return {"world": world, "sharded": sharded, "tokens": done[0]["tokens"], "median_seconds": round(seconds, 2),
            "tokens_per_s": round(done[0]["tokens"] / seconds), "all_seconds": [round(r["seconds"], 2) for r in done],
            "steps_per_rank": done[0]["batches"], "sae_steps": done[0]["sae_steps"],
            "collectives_per_rank": done[0]["comm"]["calls"], "collective_seconds_rank0": round(spent, 3),
            "collective_ms_per_step": round(1000 * spent / steps, 2),
            "allreduce_ms_per_step": round(1000 * reduce / steps, 2),
            "state_mib_per_rank": done[-1]["state_mib_ranks"], "state_mib_rank0_by_site": done[-1]["state_mib_by_site"],
            "peak_rss_mib_per_rank": done[-1]["peak_rss_mib_ranks"]}


def _table(rows: dict[str, dict]) -> str:
    """One markdown row per run, each figure next to its baseline: tokens/s next to 1 unsharded
    process's, memory next to the unsharded fit's on as many processes."""
    base = {(r["world"], r["sharded"]): r for r in rows.values()}
    head = ("| processes | sharded | tokens/s | x 1 process | all-reduce ms/step | all collectives ms/step "
            "| state MiB/rank (max) | x unsharded | peak RSS MiB/rank (max) | x unsharded |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows.values():
        one, flat = base.get((1, False)), base.get((r["world"], False))
        state, rss = max(r["state_mib_per_rank"]), max(r["peak_rss_mib_per_rank"])
        lines.append(
            f"| {r['world']} | {'yes' if r['sharded'] else 'no'} | {r['tokens_per_s']:,} "
            f"| {_ratio(r['tokens_per_s'], one and one['tokens_per_s'])} | {r['allreduce_ms_per_step']} "
            f"| {r['collective_ms_per_step']} | {state} | {_ratio(state, flat and max(flat['state_mib_per_rank']))} "
            f"| {rss} | {_ratio(rss, flat and max(flat['peak_rss_mib_per_rank']))} |")
    tokens = sorted({r["tokens"] for r in rows.values()})
    steps = "; ".join(f"{k}: {r['steps_per_rank']}" for k, r in rows.items())
    return "\n".join(lines + [f"\n(every run: {', '.join(map(str, tokens))} tokens; fit steps per rank: {steps})"])


def _ratio(value: float, baseline: float | None) -> str:
    return "" if not baseline else f"{value / baseline:.2f}x"


def _allreduce_table(hidden: int) -> None:
    sae = 2 * (4 * hidden) * hidden + 4 * hidden + hidden + 4 * hidden + 4
    sizes = sorted({3, 32 * hidden + 32 + 1, sae, 4608 * 576 * 2})
    codes, results, _ = W.spawn(_allreduce_body, 2, Path("/tmp/conceptlens_bench_allreduce"), sizes, 20,
                                timeout=600, collective_timeout=300)
    if codes != [0, 0]:
        raise SystemExit(f"all-reduce timing failed: {results}")
    print(json.dumps({"allreduce_ms_by_float64_elements": results[0]}, indent=2))


if __name__ == "__main__":
    main()
