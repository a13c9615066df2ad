"""The demo's steering comparison, judged by a model that is not the steered one.

Four ways to push unrelated prompts toward a topic, each swept over the same alphas in the
same unit (`Add(..., scale="robust_norm")`): the run's chosen concept (centred where the set
has a mean), the difference of mean activations of topic vs other-topic training articles at
the same site, a random direction (the control), and an unsteered prompt prefix
("Write about TOPIC. "). Each continuation is scored by `TopicJudge` (MiniLM embeddings +
logistic regression on the BBC train split) and by its perplexity under the unsteered model;
a row's result is its best mean P(topic) among the alphas within the fluency budget.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from conceptlens.steering.compare import ALPHAS, PROMPTS, compare, diff_of_means, mean_activation

__all__ = ["ALPHAS", "PROMPTS", "compare", "diff_of_means", "format_rows", "mean_activation", "pick_concept",
           "steer_example", "verdict", "write_rows"]


JUDGE_TOKENS = 64
"""Tokens of each article the judge learns from and is scored on: it judges 20-token continuations,
so 128-token openings gain it little there and cost twice the time (held-out accuracy 0.941 at 64
tokens, 0.964 at 128; 16 s against 33 s on 2 cores)."""


def format_rows(rows: list[dict[str, Any]], topic: str) -> str:
    """The table: P(topic) and median perplexity per alpha, and the best P within the budget."""
    alphas = max((r["alphas"] for r in rows), key=len)
    width = max(14, *(len(r["row"]) for r in rows))
    head = f"{'':<{width}}  {'':<10}" + "".join(f"{'a=' + format(a, 'g'):>8}" for a in alphas)
    lines = [head + "   best within budget"]
    for r in rows:
        cells = {a: (p, q) for a, p, q in zip(r["alphas"], r["p"], r["perplexity"])}
        best = "over budget" if r["best"] is None else f"{r['best'][1]:.3f} at alpha {r['best'][0]:g}"
        if r["best"] is not None and r["best"][0] == 0 and len(r["alphas"]) > 1:
            best += " (unsteered)"  # a direction none of whose alphas within the budget scored higher
        lines.append(f"{r['row']:<{width}}  {'P(' + topic + ')':<10}"
                     + "".join(f"{cells[a][0]:>8.3f}" if a in cells else f"{'':>8}" for a in alphas) + f"   {best}")
        lines.append(f"{'':<{width}}  {'perplexity':<10}"
                     + "".join(f"{cells[a][1]:>8.1f}" if a in cells else f"{'':>8}" for a in alphas))
    return "\n".join(lines)


def verdict(rows: list[dict[str, Any]], topic: str) -> str:
    """Which row wins (highest P(topic) within the budget, if above the unsteered continuations'),
    and whether the concept loses to the difference of means or to the random control; rows[0] is
    the concept, rows[1] diff-of-means, rows[2] the random control."""
    def best(r: dict[str, Any]) -> float:
        return -math.inf if r["best"] is None else r["best"][1]

    unsteered = rows[0]["p"][rows[0]["alphas"].index(0.0)] if 0.0 in rows[0]["alphas"] else -math.inf
    winner = max(rows, key=best)
    if not best(winner) > unsteered:
        lines = [f"No row raises P({topic}) above the unsteered continuations' ({unsteered:.3f}) within the "
                 "fluency budget"]
    else:
        lines = [f"Winner: {winner['row']} (P({topic}) {best(winner):.3f} within the fluency budget, unsteered "
                 f"{unsteered:.3f})"]
    concept, means, control = rows[0], rows[1], rows[2]
    for r in (concept, means, control):
        over = [(p, a, q) for a, p, q, ok in zip(r["alphas"], r["p"], r["perplexity"], r.get("fluent", ()))
                if not ok and r["best"] is not None and p > r["best"][1]]
        if r["best"] is not None and r["best"][0] == 0 and over:
            p, a, q = max(over)
            lines.append(f"{r['row']}: no alpha within the fluency budget raises P({topic}); its {p:.3f} at alpha "
                         f"{a:g} is over the budget (perplexity {q:.1f}), so its row is the unsteered continuations.")
    if best(concept) < best(means):
        lines.append(f"The fitted concept loses to the diff-of-means vector ({best(concept):.3f} vs "
                     f"{best(means):.3f}), as AxBench found for SAE latents.")
    if best(concept) <= best(control):
        lines.append(f"The fitted concept does no better than a random direction ({best(concept):.3f} vs "
                     f"{best(control):.3f}).")
    return "\n".join(lines)


def write_rows(rows: list[dict[str, Any]], topic: str, accuracy: float, path: Path) -> None:
    from conceptlens._io import atomic_write

    text = json.dumps({"topic": topic, "judge_accuracy": accuracy, "rows": rows}, indent=1)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def steer_example(lens: Any, tok: Any, descriptions: dict[str, Any], labels: list[str], rows: Any,
                  args: argparse.Namespace, out: Path) -> None:
    """The demo's steering example: the concept `pick_concept` finds for `args.topic` against the
    diff-of-means vector of the probe's train `rows`, a random direction and the prompt prefix, judged
    by a MiniLM topic classifier; printed, written to RUN/steering.json and to the concept's page."""
    from conceptlens import data
    from conceptlens._io import atomic_write
    from conceptlens.commands._common import load_model
    from conceptlens.commands.demo_probe import save_part
    from conceptlens.evaluate.activations import pick, pick_unread
    from conceptlens.commands.demo_quality import best_per_class
    from conceptlens.concepts.conceptset import ConceptSet
    from conceptlens.evaluate.steering import diff_of_means as rows_diff_of_means  # of probed rows
    from conceptlens.evaluate.steering import label_lines
    from conceptlens.steering.judge import TopicJudge
    from conceptlens.steering.units import robust_norm

    start = time.perf_counter()
    name, concept, loss = pick_concept(descriptions, labels, args.topic)
    if name is None:
        print(f"\nNo concept's top contexts come mostly from {args.topic!r} articles: no steering example")
        return
    d, site = descriptions[name], descriptions[name].info["site"]
    base = d.info["base_rate_entropy"][args.topic]
    norm = robust_norm(lens, site)  # the unit of Add(..., scale="robust_norm")
    print(f"\nSteering with {name} concept {concept}, the best {args.topic!r} probe among concepts whose top "
          f"contexts are mostly {args.topic} articles (log-loss {loss:.3f} vs base rate {base:.3f}; best over "
          f"{d.info['n_concepts']} random directions "
          f"{best_per_class(descriptions['random'], d.info['n_concepts']).get(args.topic, (float('nan'),))[0]:.3f})")
    train, test = data.load("bbc-news", "train"), data.load("bbc-news", "test")
    encoder, encoder_tok = load_model(args, args.judge_model)
    learn = pick(len(train), args.judge_docs, args.seed)
    judge = TopicJudge(encoder, encoder_tok, [train.texts[i] for i in learn], [train.labels[i] for i in learn],
                       max_length=JUDGE_TOKENS, seed=args.seed)
    learnt = {train.texts[i] for i in learn}  # the test split repeats some train articles: not held out
    held = pick_unread(test, len(test), args.seed, learnt)
    accuracy = judge.accuracy([test.texts[i] for i in held], [test.labels[i] for i in held])
    print(f"Judge: logistic regression on mean-pooled {args.judge_model} embeddings of {len(learn)} train "
          f"articles (first {JUDGE_TOKENS} tokens); held-out accuracy {accuracy:.3f} on {len(held)} test articles "
          "(none a copy of one it learned on)")
    cs = ConceptSet.load(out / "concepts" / name)
    directions = {f"{name}:{concept}" + (" centred" if cs.mean is not None else ""):
                  (cs.centred() if cs.mean is not None else cs).directions[concept],
                  "diff-of-means": rows_diff_of_means(rows, train.label_names.index(args.topic))}
    g = torch.Generator().manual_seed(2_000_003 + args.seed)
    directions["random"] = torch.randn(cs.d, generator=g)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    rows = compare(lens, tok, site, norm, directions, judge.topic(args.topic), args.topic, args.prompt)
    print(f"P({args.topic}) of the continuations by the judge, median perplexity under the unsteered model; alpha "
          f"in robust norms ({norm:.3g}); best within budget: perplexity at most 2x the unsteered, "
          "at most half the 3-grams repeated")
    print(format_rows(rows, args.topic))
    print(verdict(rows, args.topic))
    write_rows(rows, args.topic, accuracy, out / "steering.json")
    save_part(args, {name: cs}, site, f"demo: steering toward {args.topic}",
              {"topic": args.topic, "prompts": list(args.prompt), "judge_model": args.judge_model,
               "judge_docs": args.judge_docs, "seed": args.seed}, time.perf_counter() - start,
              label_lines("bbc-news", args.topic, {name: (concept, next(iter(directions)))}, rows, args.seed))
    samples = [{"alpha": a, "scale": "robust_norm", "text": texts[0]} for a, texts in zip(rows[0]["alphas"],
                                                                                        rows[0]["texts"])]
    path = out / "describe" / name / "description.json"
    info = json.loads(path.read_text())
    info["steering"] = [*info.get("steering", []), {"concept": concept, "prompt": args.prompt[0],
                                                    "norm": norm, "samples": samples}]
    text = json.dumps(info, indent=1)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def pick_concept(descriptions: dict[str, Any], labels: list[str], topic: str) -> tuple[Any, Any, float]:
    """(set, concept, loss): the lowest `topic` probe loss among concepts of the fitted sets whose
    top contexts come mostly from `topic` documents (so that adding the direction means more topic)."""
    best: tuple[Any, Any, float] = (None, None, float("inf"))
    for name, d in descriptions.items():
        if name == "random" or "probe_loss" not in d.stats:
            continue
        c = d.info["labels"].index(topic)
        for j in torch.argsort(d.stats["probe_loss"][:, c]).tolist()[:50]:
            docs = [ctx["doc"] for ctx in d.contexts[j]["contexts"]]
            share = sum(labels[doc] == topic for doc in docs) / max(len(docs), 1)
            loss = float(d.stats["probe_loss"][j, c])
            if share > 0.5 and loss < best[2]:
                best = (name, j, loss)
                break
    return best
