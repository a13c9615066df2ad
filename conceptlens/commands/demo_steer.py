"""The demo's steering comparison, judged by a model that is not the steered one.

Four ways to push unrelated prompts toward a topic, each swept over the same alphas in the
same unit (`Add(..., scale="robust_norm")`): the run's chosen concept (centred where the set
has a mean), the difference of mean activations of topic vs other-topic training articles at
the same site, a random direction (the control), and an unsteered prompt prefix
("Write about TOPIC. "). The concept is chosen by steering: each set's best probes for the
topic steer `SCREEN_PROMPTS`, other prompts than the comparison's, and the one that steers them
furthest within the fluency budget is compared; the random control is the best of as many
random directions on the same screen, so that both rows were chosen alike. Each continuation
is scored by `TopicJudge` (MiniLM embeddings + logistic regression on the BBC train split) and
by its perplexity under the unsteered model; a row's result is its best mean P(topic) among
the alphas within the fluency budget, with a bootstrap interval over the prompts; the concept is
set against diff-of-means and the random direction by paired differences over the same prompts
(`evaluate.steering.label_lines`, the lines the atlas shows).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from conceptlens.steering.compare import ALPHAS, PROMPTS, compare, diff_of_means, mean_activation

__all__ = ["ALPHAS", "PROMPTS", "SCREEN_PROMPTS", "compare", "diff_of_means", "format_rows", "intervals",
           "mean_activation", "pick_concepts", "screen", "steer_example", "verdict", "write_rows"]


CANDIDATES_PER_SET = 2
"""Concepts of each set the screen steers: its best probes for the topic (SmolLM2, seed 0: the best
of 6 on the screen steered the 16 comparison prompts to 0.41 at alpha 0.5, where the best probe
alone, a k-means concept, reached 0.18 and steered like a random direction; EVALUATION.md)."""
SCREEN_PROMPTS = ("The meeting on Tuesday was moved because", "She poured the tea and",
                  "The train was late again, so", "On the table next to the window there was",
                  "My first job after school was", "The parcel arrived this morning and",
                  "We painted the kitchen yellow and", "At the top of the hill, the view")
"""Neutral openings the steered concept (and the random control) is chosen on; none is one of
`PROMPTS`, which the comparison is scored on."""
SCREEN_ALPHAS = (0.0, 0.375, 0.5, 0.75)
"""Where the demo's directions stay within the fluency budget on SmolLM2 and Gemma-3, or just leave it."""
SCREEN_TOKENS = 12
"""Tokens per screen continuation (the comparison's `TOKENS` cost twice the decoding steps)."""
TOKENS = 20
"""Tokens per continuation of the comparison."""
JUDGE_TOKENS = 64
"""Tokens of each article the judge learns from and is scored on: it judges 20-token continuations,
so 128-token openings gain it little there and cost twice the time (held-out accuracy 0.941 at 64
tokens, 0.964 at 128; 16 s against 33 s on 2 cores)."""


def format_rows(rows: list[dict[str, Any]], topic: str, intervals: Mapping[str, Any] | None = None) -> str:
    """The table: P(topic) and median perplexity per alpha, and the best P within the budget (with its
    95% interval over the prompts where `intervals`, row name -> `Estimate`, has the row)."""
    alphas = max((r["alphas"] for r in rows), key=len)
    width = max(14, *(len(r["row"]) for r in rows))
    head = f"{'':<{width}}  {'':<10}" + "".join(f"{'a=' + format(a, 'g'):>8}" for a in alphas)
    lines = [head + "   best within budget"]
    for r in rows:
        cells = {a: (p, q) for a, p, q in zip(r["alphas"], r["p"], r["perplexity"])}
        best = "over budget"
        if r["best"] is not None:
            est = (intervals or {}).get(r["row"])
            best = f"{r['best'][1]:.3f}" + ("" if est is None or math.isnan(est.low) else
                                           f" [{est.low:.3f}, {est.high:.3f}]")
            if len(r["alphas"]) > 1:  # a prefix row has no alpha to name
                best += f" at alpha {r['best'][0]:g}"
        if r["best"] is not None and r["best"][0] == 0 and len(r["alphas"]) > 1:
            best += " (unsteered)"  # a direction none of whose alphas within the budget scored higher
        lines.append(f"{r['row']:<{width}}  {'P(' + topic + ')':<10}"
                     + "".join(f"{cells[a][0]:>8.3f}" if a in cells else f"{'':>8}" for a in alphas) + f"   {best}")
        lines.append(f"{'':<{width}}  {'perplexity':<10}"
                     + "".join(f"{cells[a][1]:>8.1f}" if a in cells else f"{'':>8}" for a in alphas))
    return "\n".join(lines)


def intervals(rows: list[dict[str, Any]], lines: list[Any]) -> dict[str, Any]:
    """Row name -> the `Estimate` of its best score within the budget, from `label_lines`' first line
    (the concept, rows[0], next to the random, diff-of-means and prompt-prefix rows)."""
    first = lines[0]
    bases = dict(first.baselines)
    return {rows[0]["row"]: first.value, "random": bases["random direction"],
            "diff-of-means": bases["diff-of-means"], rows[-1]["row"]: bases["prompt prefix"]}


def verdict(rows: list[dict[str, Any]], topic: str, lines: Sequence[Any] = ()) -> str:
    """Which row wins (highest P(topic) within the budget, if above the unsteered continuations'),
    and how the concept steers against the difference of means and the random control by
    `label_lines`' paired differences over the prompts (`lines`); rows[0] is the concept, rows[1]
    diff-of-means, rows[2] the random control."""
    from conceptlens.evaluate.lines import verdict as line_verdict

    unsteered = rows[0]["p"][rows[0]["alphas"].index(0.0)] if 0.0 in rows[0]["alphas"] else -math.inf
    winner = max(rows, key=_best)
    if not _best(winner) > unsteered:
        said = [f"No row raises P({topic}) above the unsteered continuations' ({unsteered:.3f}) within the "
                "fluency budget"]
    else:
        said = [f"Highest point value within the fluency budget: {winner['row']} (P({topic}) {_best(winner):.3f}, "
                f"unsteered {unsteered:.3f})"]
    concept, means, control = rows[0], rows[1], rows[2]
    for r in (concept, means, control):
        repeats = r.get("repetition") or [math.nan] * len(r["alphas"])
        over = [(p, a, q, rep) for a, p, q, rep, ok in zip(r["alphas"], r["p"], r["perplexity"], repeats,
                                                            r.get("fluent", ()))
                if not ok and r["best"] is not None and p > r["best"][1]]
        if r["best"] is not None and r["best"][0] == 0 and over:
            p, a, q, rep = max(over)
            why = f"median perplexity {q:.1f}" + ("" if math.isnan(rep) else f", median 3-gram repetition {rep:.2f}")
            said.append(f"{r['row']}: no alpha within the fluency budget raises P({topic}); its {p:.3f} at alpha "
                        f"{a:g} is over the budget ({why}), so its row is the unsteered continuations.")
    how = {"wins": "better than", "overlaps": "no differently (by this interval) from", "loses": "worse than"}
    for base, name in (("diff-of-means", "the diff-of-means vector"), ("random", "a random direction")):
        paired = next((ln for ln in lines if ln.metric.endswith(f" minus {base}")), None)
        if paired is None:
            continue
        if not line_verdict(paired):
            said.append(f"The fitted concept cannot be compared with {name}: a row is over the fluency budget at "
                        "every alpha.")
            continue
        d = paired.value
        tail = ", as AxBench found for SAE latents" if base == "diff-of-means" and line_verdict(paired) == "loses" \
            else ""
        if base == "random" and control["best"] is not None and control["best"][0] == 0:
            tail = (" (the random direction's best within the budget is alpha 0, so this sets the concept against no "
                    "steering)")
        said.append(f"The fitted concept steers {how[line_verdict(paired)]} {name}: paired difference {d.value:+.3f} "
                    f"[{d.low:+.3f}, {d.high:+.3f}] over the {len(concept['scores'][0])} prompts{tail}.")
    return "\n".join(said)


def _best(row: dict[str, Any]) -> float:
    """A row's best P within the budget; -inf for a row over the budget at every alpha."""
    return -math.inf if row["best"] is None else row["best"][1]


def write_rows(rows: list[dict[str, Any]], topic: str, accuracy: float, path: Path) -> None:
    from conceptlens._io import atomic_write

    text = json.dumps({"topic": topic, "judge_accuracy": accuracy, "rows": rows}, indent=1)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def steer_example(lens: Any, tok: Any, descriptions: dict[str, Any], labels: list[str], rows: Any,
                  args: argparse.Namespace, out: Path) -> None:
    """The demo's steering example: the concept `screen` chooses for `args.topic` among each set's
    best probes (`pick_concepts`) against the diff-of-means vector of the probe's train `rows`, the
    random direction the same screen chooses among as many, and the prompt prefix, judged by a
    MiniLM topic classifier on `args.prompt`; printed, written to RUN/steering.json and to the
    concept's page."""
    from conceptlens import data
    from conceptlens._io import atomic_write
    from conceptlens.commands._common import load_model
    from conceptlens.commands.demo_probe import save_part
    from conceptlens.evaluate.activations import pick, pick_unread
    from conceptlens.concepts.conceptset import ConceptSet
    from conceptlens.evaluate.steering import diff_of_means as rows_diff_of_means  # of probed rows
    from conceptlens.evaluate.steering import label_lines, steer_direction
    from conceptlens.steering.judge import TopicJudge
    from conceptlens.steering.units import robust_norm

    start = time.perf_counter()
    candidates = pick_concepts(descriptions, labels, args.topic, CANDIDATES_PER_SET)
    if not candidates:
        print(f"\nNo concept's top contexts come mostly from {args.topic!r} articles: no steering example")
        return
    site = descriptions[candidates[0][0]].info["site"]
    norm = robust_norm(lens, site)  # the unit of Add(..., scale="robust_norm")
    train, test = data.load("bbc-news", "train"), data.load("bbc-news", "test")
    encoder, encoder_tok = load_model(args, args.judge_model)
    learn = pick(len(train), args.judge_docs, args.seed)
    judge = TopicJudge(encoder, encoder_tok, [train.texts[i] for i in learn], [train.labels[i] for i in learn],
                       max_length=JUDGE_TOKENS, seed=args.seed)
    learnt = {train.texts[i] for i in learn}  # the test split repeats some train articles: not held out
    held = pick_unread(test, len(test), args.seed, learnt)
    accuracy = judge.accuracy([test.texts[i] for i in held], [test.labels[i] for i in held])
    print(f"\nJudge: logistic regression on mean-pooled {args.judge_model} embeddings of {len(learn)} train "
          f"articles (first {JUDGE_TOKENS} tokens); held-out accuracy {accuracy:.3f} on {len(held)} test articles "
          "(none a copy of one it learned on)")
    sets = {name: ConceptSet.load(out / "concepts" / name) for name, _, _ in candidates}
    concepts = {_row_name(name, j, sets[name]): steer_direction(sets[name], j) for name, j, _ in candidates}
    g = torch.Generator().manual_seed(2_000_003 + args.seed)
    d = next(iter(sets.values())).d
    randoms = {f"random {i}": torch.randn(d, generator=g) for i in range(len(concepts))}
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    prompts = list(SCREEN_PROMPTS)  # none of args.prompt (demo refuses those at the start)
    key, random_key, screened = screen(lens, tok, site, norm, concepts, randoms, judge.topic(args.topic), args.topic,
                                       prompts)
    name, concept, loss = next(c for c in candidates if _row_name(c[0], c[1], sets[c[0]]) == key)
    print(screen_summary(screened, args.topic, prompts, key, random_key))
    cs = sets[name]
    directions = {key: concepts[key], "diff-of-means": rows_diff_of_means(rows, train.label_names.index(args.topic)),
                  "random": randoms[random_key]}
    rows = compare(lens, tok, site, norm, directions, judge.topic(args.topic), args.topic, args.prompt,
                   max_new_tokens=TOKENS)
    print(f"\nSteering {len(args.prompt)} other prompts with {name} concept {concept} ({args.topic} probe "
          f"log-loss {loss:.3f}), the diff-of-means vector, {random_key} (row \"random\") and the prompt prefix; "
          f"P({args.topic}) of {TOKENS}-token continuations by the judge, median perplexity under the unsteered "
          f"model; alpha in robust norms ({norm:.3g}: the site's median token norm without its massive "
          "coordinates); each row walks out from alpha 0 and ends at its first alpha over the fluency budget (at "
          "least half the continuations within 2x the unsteered median perplexity and with at most half their "
          "3-grams repeated); best within budget: the highest P on that walk, with a 95% bootstrap interval over "
          f"the {len(args.prompt)} prompts (alpha chosen on the same prompts)")
    how = (f"{name} concept {concept} and the random direction each the best of {len(concepts)} on "
           f"{len(prompts)} screen prompts")
    lines = label_lines("bbc-news", args.topic, {name: (concept, key)}, rows, args.seed, how)
    print(format_rows(rows, args.topic, intervals(rows, lines)))
    reference = rows[0]["perplexity"][rows[0]["alphas"].index(0.0)]
    print(f"(unsteered median perplexity {reference:.1f}: the budget's limit is {2 * reference:.1f} per continuation)")
    print(verdict(rows, args.topic, lines))
    write_rows(rows, args.topic, accuracy, out / "steering.json")
    save_part(args, {name: cs}, site, f"demo: steering toward {args.topic}",
              {"topic": args.topic, "prompts": list(args.prompt), "screen_prompts": prompts,
               "candidates": list(concepts), "judge_model": args.judge_model, "judge_docs": args.judge_docs,
               "seed": args.seed}, time.perf_counter() - start, lines)
    samples = [{"alpha": a, "scale": "robust_norm", "text": texts[0]} for a, texts in zip(rows[0]["alphas"],
                                                                                        rows[0]["texts"])]
    path = out / "describe" / name / "description.json"
    info = json.loads(path.read_text())
    info["steering"] = [*info.get("steering", []), {"concept": concept, "prompt": args.prompt[0],
                                                    "positions": "generated", "norm": norm, "samples": samples}]
    text = json.dumps(info, indent=1)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def _row_name(name: str, j: int, cs: Any) -> str:
    return f"{name}:{j}" + (" centred" if cs.mean is not None else "")


def pick_concepts(descriptions: dict[str, Any], labels: list[str], topic: str,
                  per_set: int) -> list[tuple[str, int, float]]:
    """(set, concept, loss) of up to `per_set` concepts of each fitted set: the lowest `topic` probe
    losses among its concepts whose top contexts come mostly from `topic` documents (so that adding
    the direction means more topic), lowest loss first over all sets."""
    found = []
    for name, d in descriptions.items():
        if name == "random" or "probe_loss" not in d.stats:
            continue
        c = d.info["labels"].index(topic)
        kept = []
        for j in torch.argsort(d.stats["probe_loss"][:, c]).tolist()[:50]:
            docs = [ctx["doc"] for ctx in d.contexts[j]["contexts"]]
            if sum(labels[doc] == topic for doc in docs) / max(len(docs), 1) > 0.5:
                kept.append((name, j, float(d.stats["probe_loss"][j, c])))
                if len(kept) == per_set:
                    break
        found += kept
    return sorted(found, key=lambda c: c[2])


def screen(lens: Any, tok: Any, site: str, norm: float, concepts: dict[str, torch.Tensor],
           randoms: dict[str, torch.Tensor], judge: Any, topic: str,
           prompts: Sequence[str]) -> tuple[str, str, list[dict[str, Any]]]:
    """(concept row, random row, the screen's rows): the concept of `concepts` and the direction of
    `randoms` (as many, the control chosen the same way) whose best P(topic) within the fluency
    budget is highest when steering `prompts` at `SCREEN_ALPHAS` for `SCREEN_TOKENS` tokens; the
    first of each (the best probe) when none stays within the budget."""
    if set(concepts) & set(randoms):
        raise ValueError(f"screen: concept and random rows share names {sorted(set(concepts) & set(randoms))}")
    rows = compare(lens, tok, site, norm, concepts | randoms, judge, topic, prompts, SCREEN_ALPHAS,
                   max_new_tokens=SCREEN_TOKENS)
    assert len(rows) == len(concepts) + len(randoms) + 1  # then the prompt-prefix row

    n = len(concepts)
    return (max(rows[:n], key=_best)["row"], max(rows[n:n + len(randoms)], key=_best)["row"], rows)


def screen_summary(rows: list[dict[str, Any]], topic: str, prompts: Sequence[str], key: str,
                   random_key: str) -> str:
    """The screen in two lines: each candidate's best P(topic) within the budget, then the chosen ones."""
    def cell(r: dict[str, Any]) -> str:
        if r["best"] is None:
            return f"{r['row']} over budget"
        return f"{r['row']} {r['best'][1]:.2f}" + (" (unsteered)" if r["best"][0] == 0 else "")

    return (f"Choosing the steered concept on {len(prompts)} prompts of their own (not the comparison's), alphas "
            f"{', '.join(format(a, 'g') for a in SCREEN_ALPHAS)}, {SCREEN_TOKENS} tokens: best P({topic}) within the "
            f"fluency budget of the candidates (each set's {CANDIDATES_PER_SET} best {topic} probes among its concepts "
            f"whose top contexts are mostly {topic} articles; \"centred\": steered without the set's mean, as its "
            f"activations are read) and of as many random directions, none preselected (the control, chosen by the "
            "same screen)\n  " + "; ".join(cell(r) for r in rows[:-1])
            + f"\n  chosen: {key} and {random_key}"
            + ("; (unsteered): no alpha within the budget did better than alpha 0"
               if any(r["best"] is not None and r["best"][0] == 0 for r in rows[:-1]) else ""))
