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
from typing import Any, Sequence

import torch

from conceptlens.batching import encode_batch

ALPHAS = (0.0, 0.25, 0.5, 1.0, 2.0)
PROMPTS = ("My favourite recipe for a quick dinner is", "The weather this morning was",
           "I opened the letter from my bank and")


@torch.no_grad()
def mean_activation(lens: Any, tokenizer: Any, site: str, texts: Sequence[str], max_length: int = 128,
                    batch_size: int = 16) -> torch.Tensor:
    """(d,) mean activation at `site` over every (non-padding) token of `texts`."""
    device = next(lens.model.parameters()).device
    total, count = None, 0
    with lens.capture(site) as cap:
        for start in range(0, len(texts), batch_size):
            batch = encode_batch(tokenizer, list(texts[start:start + batch_size]), max_length)
            acts = cap.forward(**{k: v.to(device) for k, v in batch.items()})[site].flatten(1).double().cpu()
            total = acts.sum(0) if total is None else total + acts.sum(0)
            count += acts.shape[0]
    return (total / count).float()


def diff_of_means(lens: Any, tokenizer: Any, site: str, texts: Sequence[str], labels: Sequence[Any], topic: Any,
                  n: int = 48, seed: int = 0) -> torch.Tensor:
    """Mean activation over `n` `topic` texts minus that over `n` texts of the other topics (seeded draw)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(texts), generator=g).tolist()
    pos = [texts[i] for i in order if labels[i] == topic][:n]
    neg = [texts[i] for i in order if labels[i] != topic][:n]
    return mean_activation(lens, tokenizer, site, pos) - mean_activation(lens, tokenizer, site, neg)


def compare(lens: Any, tokenizer: Any, site: str, norm: float, directions: dict[str, torch.Tensor], judge: Any,
            topic: str, prompts: Sequence[str] = PROMPTS, alphas: Sequence[float] = ALPHAS,
            max_new_tokens: int = 20, prefix: str | None = None) -> list[dict[str, Any]]:
    """One row per direction (swept over `alphas`) plus the prompt-prefix row (unsteered; `prefix`,
    by default "Write about TOPIC. "). Each row keeps its per-prompt judged scores (`scores`, per alpha)."""
    from conceptlens.steering import Add, sweep, token_logprob
    from conceptlens.steering.judge import best_within_budget

    name, score = f"P({topic})", token_logprob(tokenizer, [f" {topic}"])
    rows, reference = [], None
    for label, vector in directions.items():
        edit = Add(vector, 0.0, scale="robust_norm", norm=norm, site=site)
        result = sweep(lens, edit, alphas, list(prompts), score, max_new_tokens=max_new_tokens,
                       judge=judge, tokenizer=tokenizer)
        reference = float(result.reference.nanquantile(0.5))
        best = best_within_budget(result, name)
        rows.append({"row": label, "alphas": result.alphas, "p": _judged(result, name).nanmean(1).tolist(),
                     "scores": _judged(result, name).tolist(),
                     "perplexity": result.median_perplexity.tolist(), "best": best, "texts": result.texts})
    prefix = f"Write about {topic}. " if prefix is None else prefix
    edit = Add(next(iter(directions.values())), 0.0, scale="robust_norm", norm=norm, site=site)  # alpha 0: no edit
    result = sweep(lens, edit, [0.0], [prefix + p for p in prompts], score, max_new_tokens=max_new_tokens,
                   judge=judge, tokenizer=tokenizer)
    p, ppl = float(_judged(result, name).nanmean()), float(result.median_perplexity[0])
    fluent = reference is not None and math.isfinite(ppl) and ppl <= 2 * reference
    rows.append({"row": f"prefix {prefix.strip()!r}", "alphas": [0.0], "p": [p], "perplexity": [ppl],
                 "scores": _judged(result, name).tolist(),
                 "best": (0.0, p) if fluent else None, "texts": result.texts})
    return rows


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


def _judged(result: Any, name: str) -> torch.Tensor:
    """The sweep's `(alphas, prompts)` scores of judge `name`."""
    if result.judged is None or name not in result.judged:
        raise ValueError(f"the sweep has no judged score {name!r}; pass judge=")
    return result.judged[name]

