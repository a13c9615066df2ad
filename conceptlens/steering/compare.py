"""Steer prompts toward a topic four ways and judge each continuation by a model that is not
the steered one: the library side of the demo's comparison (`commands.demo_steer` prints it) and
of the suite's steering part (`evaluate.steering`).

Each row is swept over the same alphas in the same unit (`Add(..., scale="robust_norm")`): a
chosen concept, the difference of mean activations of topic vs other-topic texts at the same
site, a random direction (the control), and an unsteered prompt prefix ("Write about TOPIC. ").
Each continuation is scored by a judge (`steering.judge.TopicJudge`), by its perplexity under
the unsteered model and by its share of repeated 3-grams; a row's result is its best mean
P(topic) among the alphas within the fluency budgets (`steering.judge.best_within_budget`). The
directions are swept together: one batched generation holds every direction's copy of the
prompts at every alpha (`RowsAdd`, left-padded with attention masks), which gives each row what a
sweep of its own `Add` gives; a row ends at the first alpha that breaks the budget.
Every generation and perplexity reading starts from one cached unsteered forward of the prompts
(`PromptCache`), which steering at generated positions never changes.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from conceptlens.batching import encode_batch
from conceptlens.devices import input_device
from conceptlens.interface import AttachedModel
from conceptlens.steering.edits import Add, add_vector
from conceptlens.steering.prompt_cache import PromptCache
from conceptlens.steering.sweep import SweepResult

ALPHAS = (0.0, 0.25, 0.375, 0.5, 0.75, 1.0)
"""The demo's sweep, in robust norms: on SmolLM2 (seed 0, 16 prompts) the diff-of-means vector and
the steered SAE latent leave the fluency budget at 0.75; at 2 no direction stayed within it."""
PROMPTS = ("My favourite recipe for a quick dinner is", "The weather this morning was",
           "Yesterday I finally cleaned the garage and", "The best way to learn a new language is",
           "My neighbour's cat keeps", "After lunch we walked along the river and",
           "In the back of the kitchen drawer I found", "The instructions for the bookshelf said to",
           "My grandmother always kept a jar of", "When the kettle boiled, she",
           "The path through the forest led to", "Every Sunday morning my brother",
           "I planted tomatoes in the garden and", "The old house at the end of the street",
           "Before going to bed, I usually", "The bus stopped at the corner and")
"""Unrelated, neutral openings: no news topic, no sentiment (a judge reads only the continuation).
Sixteen: with 3 or 4 the intervals over prompts were too wide to tell almost any two rows apart, and
a step of a small model costs little more for 16 rows than for 4."""


@torch.no_grad()
def mean_activation(lens: AttachedModel, tokenizer: Any, site: str, texts: Sequence[str], max_length: int = 128,
                    batch_size: int = 16) -> torch.Tensor:
    """(d,) mean activation at `site` over every (non-padding) token of `texts`."""
    device = input_device(lens.model)
    total: torch.Tensor | None = None
    count = 0
    with lens.capture(site) as cap:
        for start in range(0, len(texts), batch_size):
            batch = encode_batch(tokenizer, list(texts[start:start + batch_size]), max_length)
            acts = cap.forward(**{k: v.to(device) for k, v in batch.items()})[0][site].flatten(1).double().cpu()
            total = acts.sum(0) if total is None else total + acts.sum(0)
            count += acts.shape[0]
    if total is None:
        raise ValueError(f"mean_activation: no tokens in the {len(texts)} texts")
    return (total / count).float()

def diff_of_means(lens: AttachedModel, tokenizer: Any, site: str, texts: Sequence[str], labels: Sequence[Any], topic: Any,
                  n: int = 48, seed: int = 0) -> torch.Tensor:
    """Mean activation over `n` `topic` texts minus that over `n` texts of the other topics (seeded draw)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(texts), generator=g).tolist()
    pos = [texts[i] for i in order if labels[i] == topic][:n]
    neg = [texts[i] for i in order if labels[i] != topic][:n]
    return mean_activation(lens, tokenizer, site, pos) - mean_activation(lens, tokenizer, site, neg)

class RowsAdd(Add):
    """`Add(v, alpha, scale="robust_norm")` with one direction per block of `repeat` batch rows: row b
    of the batch gets `directions[b // repeat]` (each scaled to unit norm, times alpha robust norms;
    `alpha` one for all, or one per direction), so several directions and strengths steer one
    batched generation of `repeat` prompts each."""

    def __init__(self, directions: torch.Tensor, repeat: int, alpha: float | Sequence[float], *, norm: float,
                 site: str) -> None:
        alphas = torch.as_tensor(alpha, dtype=torch.float32).reshape(-1).expand(len(directions))
        super().__init__(directions[0], float(alphas[0]), scale="robust_norm", norm=norm, site=site)
        lengths = directions.float().norm(dim=1, keepdim=True)
        if not bool((lengths > 0).all()):
            raise ValueError(f"directions {(lengths[:, 0] == 0).nonzero().flatten().tolist()} have zero norm; "
                             "a robust-norm edit needs a direction")
        self.rows = (directions.float() / lengths).repeat_interleave(repeat, 0)  # (R * repeat, d)
        self.alphas = alphas.repeat_interleave(repeat)[:, None]  # (R * repeat, 1)

    def apply(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] != self.rows.shape[0]:
            raise ValueError(f"RowsAdd holds {self.rows.shape[0]} rows; the batch has {x.shape[0]}")
        assert self.norm is not None
        return add_vector(x, (self.alphas * self.norm * self.rows)[:, None, :], mask)


def compare(lens: AttachedModel, tokenizer: Any, site: str, norm: float, directions: dict[str, torch.Tensor], judge: Any,
            topic: str, prompts: Sequence[str] | PromptCache = PROMPTS, alphas: Sequence[float] = ALPHAS,
            max_new_tokens: int = 20, prefix: str | None = None) -> list[dict[str, Any]]:
    """One row per direction (swept over `alphas`) plus the prompt-prefix row (unsteered; `prefix`,
    by default "Write about TOPIC. "). Each row keeps its per-prompt judged scores (`scores`, per
    alpha), median perplexity and repetition per alpha, and its best alpha within the budgets.

    The prompts' unsteered forward is run once (`PromptCache`; pass one to share it between
    calls, with the unsteered continuations, the fluency reference): every generation and
    perplexity reading starts from its keys and values. Every direction at every nonzero alpha is
    one batched generation (fewer decoding steps: on a CPU a step of a small model costs little
    more for 70 rows than for 4); each row then walks its alphas outward from 0 on each sign and
    stops at the first over the budget (`best_within_budget` stops its walk there), so it lists
    only the alphas it reached."""
    from conceptlens.steering.judge import best_within_budget
    from conceptlens.steering.sweep import _generate, _left_padded
    from conceptlens.steering.sweep_scores import continuation_perplexity

    if not directions:
        raise ValueError("compare needs at least one direction to sweep")
    cache = prompts if isinstance(prompts, PromptCache) else PromptCache(lens.model, tokenizer, prompts)
    name, n, model = f"P({topic})", len(cache.prompts), lens.model
    prefix = f"Write about {topic}. " if prefix is None else prefix
    kwargs = {"do_sample": False, "max_new_tokens": max_new_tokens}
    plain = cache.unsteered(model, tokenizer, **kwargs)
    unsteered = _measured(plain, cache.perplexity(model, plain), judge, name)
    texts = [prefix + p for p in cache.prompts]
    plain = _generate(model, tokenizer, _left_padded(tokenizer, texts), texts, kwargs, logits=False)
    prefixed = _measured(plain, continuation_perplexity(model, tokenizer, plain), judge, name)
    stacked = torch.stack([v.float() for v in directions.values()])
    done: list[dict[float, dict[str, Any]]] = [{} for _ in directions]
    pairs = [(r, a) for a in sorted({float(a) for a in alphas if a != 0}, key=abs) for r in range(len(directions))]
    parts: dict[tuple[int, float], dict[str, Any]] = {}
    if pairs:
        edit = RowsAdd(stacked[[r for r, _ in pairs]], n, [a for _, a in pairs], norm=norm, site=site)
        with lens.steer(edit, positions="generated"):
            steered = cache.generate(model, tokenizer, len(pairs), **kwargs)
        parts = dict(zip(pairs, _split(_measured(steered, cache.perplexity(model, steered), judge, name),
                                          [n] * len(pairs))))
    for r, row in enumerate(done):
        for sign in (1.0, -1.0):
            for alpha in sorted({a for _, a in pairs if a * sign > 0}, key=abs):
                row[alpha] = parts[(r, alpha)]
                if not _fluent(_result([alpha], [row[alpha]], unsteered, name))[0]:
                    break  # the walk ends at the first alpha over the budget
    rows = []
    for label, measured in zip(directions, done):
        if any(float(a) == 0.0 for a in alphas):
            measured[0.0] = unsteered
        swept = [float(a) for a in alphas if float(a) in measured]
        result = _result(swept, [measured[a] for a in swept], unsteered, name)
        rows.append(_row(label, result, best_within_budget(result, name)))
    result = _result([0.0], [prefixed], unsteered, name)
    rows.append(_row(f"prefix {prefix.strip()!r}", result,
                     (0.0, float(prefixed["judged"].nanmean())) if _fluent(result)[0] else None))
    return rows


def _measured(generations: list[Any], perplexity: torch.Tensor, judge: Any, name: str) -> dict[str, Any]:
    """What a row keeps of greedy continuations: texts, perplexity under the unsteered model,
    repetition, the judge's score `name`."""
    from conceptlens.steering.sweep_scores import repetition

    return {"texts": [g.text for g in generations], "perplexity": perplexity, "repetition": repetition(generations),
            "judged": torch.tensor([float(v) for v in judge(generations)[name]], dtype=torch.float64)}


def _split(measured: dict[str, Any], sizes: list[int]) -> list[dict[str, Any]]:
    """`measured` cut into consecutive blocks of `sizes` prompts."""
    out, start = [], 0
    for size in sizes:
        out.append({k: v[start:start + size] for k, v in measured.items()})
        start += size
    return out


def _result(alphas: list[float], parts: list[dict[str, Any]], unsteered: dict[str, Any], name: str) -> SweepResult:
    """A SweepResult of `parts` (one per alpha), its fluency measured against `unsteered`."""
    judged = torch.stack([p["judged"] for p in parts])
    return SweepResult(alphas, judged, [p["texts"] for p in parts], name,
                       torch.stack([p["perplexity"] for p in parts]), unsteered["perplexity"], 2.0, {name: judged},
                       torch.stack([p["repetition"] for p in parts]), unsteered["repetition"])


def _fluent(result: SweepResult) -> list[bool]:
    fluent = result.fluent
    assert fluent is not None  # _result measures fluency
    return fluent


def _row(label: str, result: SweepResult, best: tuple[float, float] | None) -> dict[str, Any]:
    """The row as the demo prints it and saves it: per alpha, mean P, median perplexity and repetition."""
    assert result.perplexity is not None and result.repetition is not None  # _result measures both
    judged = result.scores  # _result keeps the judged score as the sweep's score
    return {"row": label, "alphas": result.alphas, "p": judged.nanmean(1).tolist(), "scores": judged.tolist(),
            "perplexity": result.perplexity.nanquantile(0.5, dim=1).tolist(),
            "repetition": result.repetition.nanquantile(0.5, dim=1).tolist(), "fluent": _fluent(result),
            "best": best, "texts": result.texts}
