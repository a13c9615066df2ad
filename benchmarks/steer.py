"""Steering overhead on SmolLM2: greedy generation with one Add edit, side by side in one run.

    python benchmarks/steer.py [--new-tokens 32] [--batch 1] [--rounds 9] [--threads N]
    python benchmarks/steer.py --profile        # time inside conceptlens's hooks per step

Rows, as ratios to bare `model.generate`: a raw forward hook adding the vector at every
position; `lens.steer(Add(...))` with positions "all" and "generated"; and the same edit
through nnsight (`tracer.iter` over every step) when nnsight is installed. All rows first
report whether they generate the same tokens as the raw hook ("generated" leaves the prompt
pass unedited, so its tokens may differ).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _timing import interleaved, print_table  # noqa: E402

import conceptlens  # noqa: E402
from conceptlens import models  # noqa: E402
from conceptlens.steering import Add  # noqa: E402

PROMPTS = ["I went to the shop and", "The weather today is", "My favourite food is", "Yesterday the team"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--site", default="blocks.15.resid_out")
    parser.add_argument("--alpha", type=float, default=8.0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--profile", action="store_true", help="instead: where steering's own hooks spend time")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tok = models.load("smollm2-135m")
    tok.padding_side = "left"
    inputs = tok((PROMPTS * args.batch)[: args.batch], return_tensors="pt", padding=True)
    lens = conceptlens.attach(model, tok)
    block = int(args.site.split(".")[1])
    direction = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    vector = args.alpha * direction / direction.norm()
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
               pad_token_id=tok.pad_token_id)

    def bare():
        return model.generate(**inputs, **gen)

    def raw_hook():
        handle = model.model.layers[block].register_forward_hook(lambda m, a, out: out + vector)
        try:
            return model.generate(**inputs, **gen)
        finally:
            handle.remove()

    def lens_steer(positions: str) -> Callable[[], torch.Tensor]:
        def run():
            with lens.steer(Add(vector, 1.0, site=args.site), positions=positions):
                return model.generate(**inputs, **gen)
        return run

    rows = {"bare generate": bare, "raw forward hook (all positions)": raw_hook,
            "lens.steer Add, positions='all'": lens_steer("all"),
            "lens.steer Add, positions='generated'": lens_steer("generated")}
    nnsight_row = _nnsight_row(model, tok, inputs, gen, block, vector)
    if nnsight_row is not None:
        rows["nnsight tracer.iter Add (all positions)"] = nnsight_row

    if args.profile:
        _profile(rows["lens.steer Add, positions='generated'"])
        return
    with torch.inference_mode():
        reference = raw_hook()
        for name, fn in rows.items():
            same = torch.equal(fn(), reference)
            print(f"  {name:<40s} tokens equal to the raw hook: {same}")
        # one interleaved round per call, so both the median and the least-disturbed round are kept
        rounds = [interleaved(rows, rounds=1, warmup=0) for _ in range(args.rounds)]
    tokens = args.batch * args.new_tokens
    print(f"\nSmolLM2-135M fp32, greedy {args.new_tokens} new tokens x batch {args.batch}, Add at {args.site}, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds")
    for title, reduce in (("median", statistics.median), ("fastest round (least disturbed by other load)", min)):
        seconds = {name: reduce(r[name] for r in rounds) for name in rows}
        print_table(f"generate time, {title}", seconds, "bare generate", tokens)


def _profile(steered: Callable[[], torch.Tensor]) -> None:
    """cProfile one steered generate; print conceptlens's functions and their share of it."""
    import cProfile
    import pstats

    with torch.inference_mode():
        steered()  # warm up
        profiler = cProfile.Profile()
        profiler.runcall(steered)
    stats = pstats.Stats(profiler)
    total = stats.total_tt  # type: ignore[attr-defined]
    rows = [(cum, calls, f"{os.path.relpath(file)}:{line}({name})")
            for (file, line, name), (_, calls, _, cum, _) in stats.stats.items()  # type: ignore[attr-defined]
            if f"{os.sep}conceptlens{os.sep}" in file]
    print(f"one steered generate: {total * 1e3:.0f} ms under cProfile; conceptlens functions by cumulative time:")
    for cum, calls, where in sorted(rows, reverse=True)[:12]:
        print(f"  {cum * 1e3:8.2f} ms  {cum / total:6.2%}  {calls:5d} calls  {cum / calls * 1e6:8.1f} us/call  {where}")


def _nnsight_row(model, tok, inputs, gen, block: int, vector: torch.Tensor):
    try:
        from nnsight import TransformersModel
    except ImportError:
        print("  nnsight is not installed: its row is left out (pip install nnsight)")
        return None
    wrapped = TransformersModel(model, tokenizer=tok)

    def run():
        # a bounded tracer.iter: one step per forward, so the result can be read after the loop
        with wrapped.generate(dict(inputs), **gen) as tracer:
            for _ in tracer.iter[: gen["max_new_tokens"]]:
                wrapped.model.layers[block].output[:] += vector
            out = tracer.result.save()
        return out

    return run


if __name__ == "__main__":
    main()
