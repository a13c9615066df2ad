"""Steer prompts toward a topic four ways and judge each continuation by a model that is not
the steered one: the library side of the demo's comparison (`commands.demo_steer` prints it) and
of the suite's steering part (`evaluate.steering`).

Each row is swept over the same alphas in the same unit (`Add(..., scale="robust_norm")`): a
chosen concept, the difference of mean activations of topic vs other-topic texts at the same
site, a random direction (the control), and an unsteered prompt prefix ("Write about TOPIC. ").
Each continuation is scored by a judge (`steering.judge.TopicJudge`) and by its perplexity under
the unsteered model; a row's result is its best mean P(topic) among the alphas within the
fluency budget (`steering.judge.best_within_budget`). The directions are swept together: one
batched generation per alpha holds every direction's copy of the prompts (`RowsAdd`), which
gives each row what a sweep of its own `Add` gives, in a third of the time on SmolLM2 on CPU.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from conceptlens.batching import encode_batch
from conceptlens.interface import AttachedModel
from conceptlens.steering.edits import Add, add_vector

ALPHAS = (0.0, 0.25, 0.5, 1.0, 2.0)
PROMPTS = ("My favourite recipe for a quick dinner is", "The weather this morning was",
           "I opened the letter from my bank and")

@torch.no_grad()
def mean_activation(lens: AttachedModel, tokenizer: Any, site: str, texts: Sequence[str], max_length: int = 128,
                    batch_size: int = 16) -> torch.Tensor:
    """(d,) mean activation at `site` over every (non-padding) token of `texts`."""
    device = next(lens.model.parameters()).device
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
    of the batch gets `directions[b // repeat]` (each scaled to unit norm, times alpha robust norms),
    so several directions steer one batched generation of `repeat` prompts each."""

    def __init__(self, directions: torch.Tensor, repeat: int, alpha: float, *, norm: float, site: str) -> None:
        super().__init__(directions[0], alpha, scale="robust_norm", norm=norm, site=site)
        lengths = directions.float().norm(dim=1, keepdim=True)
        if not bool((lengths > 0).all()):
            raise ValueError(f"directions {(lengths[:, 0] == 0).nonzero().flatten().tolist()} have zero norm; "
                             "a robust-norm edit needs a direction")
        self.rows = (directions.float() / lengths).repeat_interleave(repeat, 0)  # (R * repeat, d)

    def apply(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] != self.rows.shape[0]:
            raise ValueError(f"RowsAdd holds {self.rows.shape[0]} rows; the batch has {x.shape[0]}")
        assert self.norm is not None
        return add_vector(x, (self.alpha * self.norm * self.rows)[:, None, :], mask)


def compare(lens: AttachedModel, tokenizer: Any, site: str, norm: float, directions: dict[str, torch.Tensor], judge: Any,
            topic: str, prompts: Sequence[str] = PROMPTS, alphas: Sequence[float] = ALPHAS,
            max_new_tokens: int = 20, prefix: str | None = None) -> list[dict[str, Any]]:
    """One row per direction (swept over `alphas`) plus the prompt-prefix row (unsteered; `prefix`,
    by default "Write about TOPIC. "). Each row keeps its per-prompt judged scores (`scores`, per alpha)."""
    from conceptlens.steering import sweep, token_logprob
    from conceptlens.steering.judge import best_within_budget

    if not directions:
        raise ValueError("compare needs at least one direction to sweep")
    name, score = f"P({topic})", token_logprob(tokenizer, [f" {topic}"])
    n = len(prompts)
    edit = RowsAdd(torch.stack([v.float() for v in directions.values()]), n, 0.0, norm=norm, site=site)
    together = sweep(lens, edit, alphas, list(prompts) * len(directions), score, max_new_tokens=max_new_tokens,
                     judge=judge, tokenizer=tokenizer)
    rows, reference = [], None
    for r, label in enumerate(directions):
        result = _columns(together, slice(r * n, (r + 1) * n))
        reference = float(_fluency(result)[1].nanquantile(0.5))
        rows.append({"row": label, "alphas": result.alphas, "p": _judged(result, name).nanmean(1).tolist(),
                     "scores": _judged(result, name).tolist(), "perplexity": _fluency(result)[0].tolist(),
                     "best": best_within_budget(result, name), "texts": result.texts})
    prefix = f"Write about {topic}. " if prefix is None else prefix
    unsteered = Add(next(iter(directions.values())), 0.0, scale="robust_norm", norm=norm, site=site)  # alpha 0: no edit
    result = sweep(lens, unsteered, [0.0], [prefix + p for p in prompts], score, max_new_tokens=max_new_tokens,
                   judge=judge, tokenizer=tokenizer)
    p, ppl = float(_judged(result, name).nanmean()), float(_fluency(result)[0][0])
    fluent = reference is not None and math.isfinite(ppl) and ppl <= 2 * reference
    rows.append({"row": f"prefix {prefix.strip()!r}", "alphas": [0.0], "p": [p], "perplexity": [ppl],
                 "scores": _judged(result, name).tolist(),
                 "best": (0.0, p) if fluent else None, "texts": result.texts})
    return rows


def _columns(result: Any, cols: slice) -> Any:
    """The sweep result of the prompts in `cols` alone (one direction's block of a batched sweep)."""
    take = None if result.perplexity is None else result.perplexity[:, cols]
    return result._replace(scores=result.scores[:, cols], texts=[t[cols] for t in result.texts], perplexity=take,
                           reference=None if result.reference is None else result.reference[cols],
                           judged=None if result.judged is None else {k: v[:, cols] for k, v in result.judged.items()})


def _judged(result: Any, name: str) -> torch.Tensor:
    """The sweep's `(alphas, prompts)` scores of judge `name`."""
    if result.judged is None or name not in result.judged:
        raise ValueError(f"the sweep has no judged score {name!r}; pass judge=")
    return result.judged[name]


def _fluency(result: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The sweep's median perplexity per alpha and its unsteered reference perplexities."""
    ppl, reference = result.median_perplexity, result.reference
    if ppl is None or reference is None:
        raise ValueError("the sweep measured no perplexity; run it with a tokenizer and generations")
    return ppl, reference

