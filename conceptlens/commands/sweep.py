"""`conceptlens sweep`: a dose-response table over steering strengths, with fluency next to the target.

    conceptlens sweep --concepts runs/demo/concepts/blocks.15.resid_out --concept 12 --alphas 0 0.25 0.5 1
    conceptlens sweep --direction-word " wedding" --site blocks.20.resid_out --target-word " wedding"

For each alpha (in `--scale` units, by default multiples of the site's median token norm) every
prompt is continued greedily under `Add(direction, alpha)`; each continuation gets the target
score — the log-probability of `--target-word` per step, or by default how far the
unsteered model, reading the text, finds it along the direction (`ConceptExpression`, in site
norms) — and its perplexity under the unsteered model. Pick the largest alpha that moves the
target while the perplexity stays near the alpha-0 row.
"""

from __future__ import annotations

import argparse

from conceptlens.commands._args import finite_float, nonempty_text, out_file, positive_int
from conceptlens.commands.steer import POSITIONS, SCALES, add_direction_arguments, chat_prompt, steering_direction

PROMPTS = ("I went to the shop and", "The weather today is", "My favourite thing about the city is",
           "Yesterday the committee decided to")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_direction_arguments(parser)
    parser.add_argument("--alphas", type=finite_float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0, 1.5],
                        help="strengths to try, in --scale units (default 0 0.25 0.5 0.75 1 1.5)")
    parser.add_argument("--scale", choices=SCALES, default="site_norm", help="unit of alpha (see `steer --help`)")
    parser.add_argument("--no-centre", action="store_true", help="do not centre a set that carries the fit's mean")
    parser.add_argument("--prompts", type=nonempty_text, nargs="+", default=list(PROMPTS), help="prompts to continue")
    parser.add_argument("--target-word", type=nonempty_text,
                        help="score: mean log-probability of this word's first token per step")
    parser.add_argument("--positions", choices=POSITIONS, default="generated")
    parser.add_argument("--max-new-tokens", type=positive_int, default=24)
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    parser.add_argument("--plot", metavar="PNG", type=out_file,
                        help="also save the dose-response figure of the target score")


def run(args: argparse.Namespace) -> int:
    import conceptlens
    from conceptlens.commands._common import check_generation_length, load_model
    from conceptlens.steering import Add, site_norm, sweep, token_logprob
    from conceptlens.steering.sweep_scores import ConceptExpression

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1; got {args.max_new_tokens}")
    model, tokenizer = load_model(args)
    check_generation_length(model, tokenizer, args.max_new_tokens)
    if tokenizer.pad_token is None and len(args.prompts) > 1:
        tokenizer.pad_token = tokenizer.eos_token
    lens = conceptlens.attach(model, tokenizer)
    direction, site, what = steering_direction(lens, args)
    for alpha in args.alphas:  # every alpha checked in the model's dtype before any generation
        Add(direction, alpha, scale=args.scale, site=site).bind(lens)
    mean = _mean(args) if args.concepts else None
    score = token_logprob(tokenizer, args.target_word) if args.target_word else \
        ConceptExpression(lens, direction.directions[0], site, mean=mean)
    prompts = [chat_prompt(tokenizer, p) if args.chat else p for p in args.prompts]
    result = sweep(lens, lambda a: Add(direction, a, scale=args.scale, site=site), args.alphas, prompts, score,
                   positions=args.positions, max_new_tokens=args.max_new_tokens, plot=args.plot)
    unit = {"site_norm": f"x the site's median token norm {site_norm(lens, site):.4g}", "unit": "unit direction",
            "raw": "raw direction"}[args.scale]
    print(f"steering: {what} at {site}; alpha in {unit}; positions={args.positions}; {len(prompts)} prompts")
    print(f"score: {result.label} (mean +- std over prompts); perplexity: median over prompts, under the "
          "unsteered model\n")
    print(result.table())
    pick = pick_alpha(result)
    if pick is not None:
        print(f"\nlargest alpha whose median perplexity stays within 2x the lowest alpha's: {pick:g}")
    if args.plot:
        print(f"figure saved to {args.plot}")
    return 0


def _mean(args: argparse.Namespace):
    from conceptlens import ConceptSet

    cs = ConceptSet.load(args.concepts)
    return None if args.no_centre else cs.mean


def pick_alpha(result) -> float | None:
    """The largest alpha (of those >= the smallest one) whose median perplexity is at most twice the
    smallest alpha's, or None without fluency."""
    ppl = result.median_perplexity
    if ppl is None:
        return None
    order = sorted(range(len(result.alphas)), key=lambda i: result.alphas[i])
    reference = float(ppl[order[0]])
    fluent = [result.alphas[i] for i in order if float(ppl[i]) <= 2 * reference]
    return max(fluent) if fluent else None
