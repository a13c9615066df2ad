"""`conceptlens sweep`: a dose-response table over steering strengths, with fluency next to the target.

    conceptlens sweep --concepts runs/demo/concepts/blocks.15.resid_out --concept 12 --alphas 0 0.25 0.5 1
    conceptlens sweep --direction-word " wedding" --site blocks.20.resid_out --target-word " wedding"

For each alpha (in `--scale` units, by default multiples of the site's robust token norm) every
prompt is continued greedily under `Add(direction, alpha)`; each continuation gets the target
score — the log-probability of `--target-word`s per step, or by default how far the
unsteered model, reading the text, finds it along the direction (`ConceptExpression`, in robust
norms) — and its perplexity under the unsteered model. The command names the largest alpha
whose median perplexity stays within `--budget` (2x) of the unsteered continuations' (on each side
of 0 when the alphas have both signs).
"""

from __future__ import annotations

import argparse

from conceptlens.commands._args import figure_file, finite_float, nonempty_text, positive_int
from conceptlens.commands.steer import (POSITIONS, SCALES, add_direction_arguments, chat_prompt, choose_model,
                                        steering_direction)

PROMPTS = ("I went to the shop and", "The weather today is", "My favourite thing about the city is",
           "Yesterday the committee decided to")


def budget(text: str) -> float:
    """A fluency budget: a finite multiple of the unsteered perplexity, at least 1."""
    value = finite_float(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value:g} is below 1: the budget is the most perplexity in multiples "
                                         "of the unsteered one")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_direction_arguments(parser)
    parser.add_argument("--alphas", type=finite_float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0, 1.5],
                        help="strengths to try, in --scale units (default 0 0.25 0.5 0.75 1 1.5)")
    parser.add_argument("--scale", choices=SCALES, default="robust_norm", help="unit of alpha (see `steer --help`)")
    parser.add_argument("--no-centre", action="store_true", help="do not centre a set that carries the fit's mean")
    parser.add_argument("--prompts", type=nonempty_text, nargs="+", default=list(PROMPTS), help="prompts to continue")
    parser.add_argument("--target-word", type=nonempty_text, nargs="+",
                        help="score: mean log-probability per step of these words' first tokens")
    parser.add_argument("--budget", type=budget, default=2.0,
                        help="fluency budget: the most median perplexity, in multiples of the unsteered one (2)")
    parser.add_argument("--positions", choices=POSITIONS, default="generated")
    parser.add_argument("--max-new-tokens", type=positive_int, default=24)
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    parser.add_argument("--plot", metavar="PNG", type=figure_file,
                        help="also save the dose-response figure of the target score (.png, .pdf or .svg; "
                             "after the table is printed)")


def run(args: argparse.Namespace) -> int:
    import conceptlens
    from conceptlens.commands._common import check_generation_length, check_predicts_tokens, load_model
    from conceptlens.steering import Add, sweep, token_logprob, units
    from conceptlens.steering.sweep import plot_sweep
    from conceptlens.steering.sweep_scores import ConceptExpression

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1; got {args.max_new_tokens}")
    concepts = choose_model(args)
    model, tokenizer = load_model(args)
    check_predicts_tokens(model, "sweep continues prompts, so it", "sweep a decoder (smollm2-135m, a Gemma) or an "
                          "encoder-decoder")
    check_generation_length(model, tokenizer, args.max_new_tokens)
    if tokenizer.pad_token is None and len(args.prompts) > 1:
        tokenizer.pad_token = tokenizer.eos_token
    lens = conceptlens.attach(model, tokenizer)
    direction, site, what = steering_direction(lens, args, concepts)
    for alpha in args.alphas:  # every alpha checked in the model's dtype before any generation
        Add(direction, alpha, scale=args.scale, site=site).bind(lens)
    mean = _mean(args) if args.concepts else None
    score = token_logprob(tokenizer, args.target_word) if args.target_word else \
        ConceptExpression(lens, direction.directions[0], site, mean=mean)
    prompts = [chat_prompt(tokenizer, p) if args.chat else p for p in args.prompts]
    result = sweep(lens, Add(direction, 1.0, scale=args.scale, site=site), args.alphas, prompts, score,
                   positions=args.positions, max_new_tokens=args.max_new_tokens, budget=args.budget)
    unit = {"robust_norm": f"x the site's robust token norm {units.robust_norm(lens, site):.4g}",
            "site_norm": f"x the site's median token norm {units.site_norm(lens, site):.4g}",
            "unit": "unit direction", "raw": "raw direction"}[args.scale]
    print(f"steering: {what} at {site}; alpha in {unit}; positions={args.positions}; {len(prompts)} prompts")
    print(f"score: {result.label} (mean +- std over prompts); perplexity: median over prompts, under the "
          f"unsteered model (* within {args.budget:g}x the unsteered continuations')\n")
    print(result.table())
    if result.reference is None:  # sweep measures fluency unless told not to
        raise RuntimeError("the sweep measured no fluency, so there is no unsteered perplexity to report")
    reference = float(result.reference.nanquantile(0.5))
    if result.best_alpha is None:
        print(f"\nno alpha keeps the median perplexity within {args.budget:g}x the unsteered {reference:.2f}")
    elif min(args.alphas) < 0:  # towards and away from the direction, each walked from 0 on its own
        ends = {side: result.furthest(sign) for side, sign in (("towards", 1.0), ("away from", -1.0))
                if any(a * sign > 0 for a in args.alphas)}  # a side no alpha tried is not "none"; 0 is on neither
        print(f"\nlargest alphas within the fluency budget (median perplexity at most {args.budget:g}x the "
              f"unsteered {reference:.2f}): " + ", ".join(f"{'none' if not a else f'{a:g}'} {side} the direction"
                                                          for side, a in ends.items()))
    else:
        print(f"\nlargest alpha within the fluency budget (median perplexity at most {args.budget:g}x the "
              f"unsteered {reference:.2f}): {result.best_alpha:g}")
    if args.plot:  # after the table: a figure that cannot be written loses none of the sweep's figures
        plot_sweep(result, args.plot)
        print(f"figure saved to {args.plot}")
    return 0


def _mean(args: argparse.Namespace):
    from conceptlens import ConceptSet

    cs = ConceptSet.load(args.concepts)
    return None if args.no_centre else cs.mean
