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

import json
import math
from pathlib import Path
from typing import Any

from conceptlens.steering.compare import ALPHAS, PROMPTS, compare, diff_of_means, mean_activation

__all__ = ["ALPHAS", "PROMPTS", "compare", "diff_of_means", "mean_activation", "format_rows", "verdict",
           "write_rows"]


def format_rows(rows: list[dict[str, Any]], topic: str) -> str:
    """The table: P(topic) and median perplexity per alpha, and the best P within the budget."""
    alphas = max((r["alphas"] for r in rows), key=len)
    width = max(14, *(len(r["row"]) for r in rows))
    head = f"{'':<{width}}  {'':<10}" + "".join(f"{'a=' + format(a, 'g'):>8}" for a in alphas)
    lines = [head + "   best within budget"]
    for r in rows:
        cells = {a: (p, q) for a, p, q in zip(r["alphas"], r["p"], r["perplexity"])}
        best = "over budget" if r["best"] is None else f"{r['best'][1]:.3f} at alpha {r['best'][0]:g}"
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
    if best(concept) < best(means):
        lines.append(f"The fitted concept loses to the diff-of-means vector ({best(concept):.3f} vs "
                     f"{best(means):.3f}), as AxBench found for SAE latents.")
    if best(concept) <= best(control):
        lines.append(f"The fitted concept does no better than a random direction ({best(concept):.3f} vs "
                     f"{best(control):.3f}).")
    return "\n".join(lines)


def write_rows(rows: list[dict[str, Any]], topic: str, accuracy: float, path: Path) -> None:
    Path(path).write_text(json.dumps({"topic": topic, "judge_accuracy": accuracy, "rows": rows}, indent=1))