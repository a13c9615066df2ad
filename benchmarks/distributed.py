"""2-process vs 1-process fit throughput on CPU (gloo), and the cost of the collectives.

    python benchmarks/distributed.py [--docs 400] [--hidden 128]

A random 4-block Llama (hidden 128 by default), 400 synthetic documents of <= 64 tokens,
one StreamingKMeans and one TopKSAE at blocks.2.resid_out. The same fit runs on 1 rank
and on 2 ranks (each with 1 thread); per rank we time the fit, and, by wrapping the
communicator, the seconds spent in collectives and their number. Tokens/s is the global
token count over the slowest rank's fit time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tests import distributed_workers as W


def _body(comm, out: Path, docs: int, hidden: int) -> dict:
    import transformers as tf

    import conceptlens
    from conceptlens import distributed
    from conceptlens.concepts import StreamingKMeans, TopKSAE
    from conceptlens.filters import FilterConfig
    from tests.conftest import CharTokenizer

    spent = {"seconds": 0.0, "calls": 0}
    for name in ("sum_", "max_", "gather_rows", "broadcast_", "gather_objects"):
        inner = getattr(distributed.Comm, name)

        def timed(self, *args, _inner=inner, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(self, *args, **kwargs)
            finally:
                spent["seconds"] += time.perf_counter() - start
                spent["calls"] += 1
        setattr(distributed.Comm, name, timed)
    torch.manual_seed(0)
    config = tf.LlamaConfig(num_hidden_layers=4, hidden_size=hidden, intermediate_size=4 * hidden,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=99, max_position_embeddings=128)
    lens = conceptlens.attach(tf.AutoModelForCausalLM.from_config(config).eval(), CharTokenizer())
    corpus = [f"doc {i} " + "the quick brown fox jumps over a lazy dog "[i % 9:] * 2 for i in range(docs)]
    extractors = {"blocks.2.resid_out": StreamingKMeans(32, init_size=512, seed=0),
                  "blocks.1.resid_out": TopKSAE(width=4 * hidden, k=16, batch_size=512, warmup_tokens=512, seed=0)}
    start = time.perf_counter()
    report = lens.fit(extractors, corpus, batch_size=8, max_length=64, progress=False,
                      filters=FilterConfig(max_norm_ratio=None), distributed=True)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": report.tokens, "batches": report.batches,
            "sae_steps": extractors["blocks.1.resid_out"].stats().steps, "comm": spent}


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=400)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved 1-rank / 2-rank rounds (medians)")
    parser.add_argument("--allreduce-only", action="store_true", help="only time bare all-reduces")
    args = parser.parse_args()
    sae = 2 * (4 * args.hidden) * args.hidden + 4 * args.hidden + args.hidden + 4 * args.hidden + 4
    sizes = sorted({3, 32 * args.hidden + 32 + 1, sae, 4608 * 576 * 2})
    codes, results, _ = W.spawn(_allreduce_body, 2, Path("/tmp/conceptlens_bench_allreduce"), sizes, 20,
                                timeout=600, collective_timeout=300)
    if codes != [0, 0]:
        raise SystemExit(f"all-reduce timing failed: {results}")
    print(json.dumps({"allreduce_ms_by_float64_elements": results[0]}, indent=2))
    if args.allreduce_only:
        return
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for _ in range(args.rounds):  # interleaved, so a change of machine load hits both alike
        for world in (1, 2):
            codes, results, _ = W.spawn(_body, world, Path(f"/tmp/conceptlens_bench_dist{world}"), args.docs,
                                        args.hidden, timeout=1200, collective_timeout=300)
            if codes != [0] * world:
                raise SystemExit(f"world {world} failed: {results}")
            runs[world].append({"seconds": max(r["seconds"] for r in results), **results[0]})
    rows: dict[str, object] = {}
    for world, done in runs.items():
        seconds = statistics.median(r["seconds"] for r in done)
        comm = [r["comm"] for r in done]
        calls = comm[0]["calls"]
        spent = statistics.median(c["seconds"] for c in comm)
        rows[f"{world} rank(s)"] = {
            "tokens": done[0]["tokens"], "median_seconds": round(seconds, 2),
            "tokens_per_s": round(done[0]["tokens"] / seconds), "all_seconds": [round(r["seconds"], 2) for r in done],
            "steps_per_rank": done[0]["batches"], "sae_steps": done[0]["sae_steps"],
            "collectives_per_rank": calls, "collective_seconds_rank0": round(spent, 3),
            "collective_ms_per_step": round(1000 * spent / max(done[0]["batches"], 1), 2)}
    rows["tokens_per_s_ratio_2_over_1"] = round(rows["2 rank(s)"]["tokens_per_s"] / rows["1 rank(s)"]["tokens_per_s"], 2)
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
