"""What a sweep measures besides its target: fluency, and how much a concept the text expresses.

    continuation_perplexity(model, tokenizer, generations)   # (P,) perplexity under the model as it is now
    repetition(generations)                                   # (P,) share of repeated token 3-grams
    ConceptExpression(lens, direction, site)                  # score: the text's projection on a direction

Both run the model on prompt + continuation outside any steering scope (`sweep` calls them
after the scope closes), so they judge the steered text with the unsteered model.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import torch
from torch import Tensor

from conceptlens.batching import pad_right
from conceptlens.devices import input_device
from conceptlens.interface import AttachedModel


class Generation(NamedTuple):
    """One prompt's continuation, as a score function sees it."""

    prompt: str
    text: str
    """The decoded new tokens (special tokens skipped)."""
    tokens: Tensor
    """(n,) new token ids, up to and including the first end-of-sequence token."""
    logits: Tensor
    """(n, V) raw logits of each step: row i is the distribution `tokens[i]` was chosen from."""


def _joined(tokenizer: Any, generations: Sequence[Generation]) -> tuple[dict[str, Tensor], list[int]]:
    """Right-padded prompt + continuation rows, and each prompt's length in tokens."""
    prompts = [tokenizer(g.prompt)["input_ids"] for g in generations]
    rows = [p + g.tokens.tolist() for p, g in zip(prompts, generations)]
    return pad_right(rows), [len(p) for p in prompts]


@torch.no_grad()
def continuation_perplexity(model: Any, tokenizer: Any, generations: Sequence[Generation], chunk: int = 256) -> Tensor:
    """(P,) float64 exp(mean negative log-likelihood) of each continuation's tokens given its prompt
    under `model` (nan for an empty continuation): the fluency of a steered text as the unsteered
    model reads it. Greedy unsteered text scores low (~1-3); word salad scores hundreds.
    Only the continuations' predicting positions are read, `chunk` at a time in float64."""
    batch, starts = _joined(tokenizer, generations)
    device = input_device(model)
    logits = model(**{k: v.to(device) for k, v in batch.items()}).logits  # (P, T, V), the model's dtype
    lengths = [len(g.tokens) for g in generations]
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    positions = torch.cat([torch.arange(s - 1, s - 1 + n) for s, n in zip(starts, lengths)]).long() \
        if rows.numel() else torch.zeros(0, dtype=torch.long)
    targets = batch["input_ids"][rows, positions + 1]
    chunk = logit_rows(chunk, logits.shape[-1])
    logprobs = torch.cat([_target_logprobs(logits[rows[i:i + chunk].to(device), positions[i:i + chunk].to(device)],
                                           targets[i:i + chunk]) for i in range(0, len(rows), chunk)]
                         or [torch.zeros(0, dtype=torch.float64)])
    out = torch.full((len(lengths),), math.nan, dtype=torch.float64)
    total = torch.zeros(len(lengths), dtype=torch.float64).index_add_(0, rows, logprobs)
    some = torch.tensor(lengths) > 0
    out[some] = torch.exp(-total[some] / torch.tensor(lengths, dtype=torch.float64)[some])
    return out


CHUNK_BYTES = 64 * 2**20
"""Most bytes of one float64 `(chunk, V)` copy of logits the perplexities (and the suite's CE-loss and KL
terms, `evaluate.reconstruction`) read: 256 rows of Gemma-3's 262,144-token vocabulary were 512 MiB a
copy, and the log-sum-exp made another."""


LOGITS_BYTES = 512 * 2**20
"""Most float32 logits one forward that scores text may return (the suite's CE-loss and KL forwards,
`evaluate.reconstruction`; the steering perplexities' forward over continuations,
`prompt_cache.PromptCache`): more rows run as slices. With Gemma-3's 262,144-token vocabulary,
16 documents of 128 tokens give 2 GiB of logits, 100 continuations of 12 tokens 1.2 GiB."""


def forward_rows(rows: int, length: int, vocab: int | None) -> int:
    """Rows of `length` tokens one forward may take so that its float32 logits fit `LOGITS_BYTES`:
    all `rows` when the vocabulary is unknown (`vocab_size` None), one at least."""
    return rows if vocab is None else max(1, LOGITS_BYTES // (length * vocab * 4))


def vocab_size(model: Any) -> int | None:
    """Rows of the model's output embedding (the logits' last dimension), or None when it has none."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    weight = getattr(head, "weight", None)
    return weight.shape[0] if isinstance(weight, Tensor) else None


def logit_rows(chunk: int, vocab: int) -> int:
    """Rows of `(N, vocab)` logits read at a time: `chunk`, or fewer to keep a float64 copy within
    `CHUNK_BYTES` (each row is scored alone, so the figures do not depend on it)."""
    return max(1, min(chunk, CHUNK_BYTES // (8 * vocab)))


def _target_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """(N,) float64 log-softmax of (N, V) `logits` at `targets`."""
    logits = logits.double().cpu()
    return logits.gather(1, targets[:, None])[:, 0] - logits.logsumexp(-1)


def repetition(generations: Sequence[Generation], n: int = 3) -> Tensor:
    """(P,) float64 share of each continuation's token n-grams that repeat an earlier n-gram of the
    same continuation (nan for one shorter than n): 0 for text that never repeats itself, near 1
    for a loop ("! ! ! !", "Bars Margo Bars Margo"), which perplexity alone reads as fluent."""
    out = []
    for g in generations:
        tokens = g.tokens.tolist()
        grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
        out.append(1.0 - len(set(grams)) / len(grams) if grams else math.nan)
    return torch.tensor(out, dtype=torch.float64)


class ConceptExpression:
    """Score: mean projection of the continuation's activations at `site` on a unit direction,
    measured by the unsteered model reading prompt + continuation, in multiples of the site's
    robust norm (`steering.units.robust_norm`).

        score = ConceptExpression(lens, cs.centred().directions[12], "blocks.15.resid_out", mean=cs.mean)

    With `mean`, the projection of `x - mean` (how far above its typical value the text puts
    the concept). On the same scale as `Add(..., scale="robust_norm")`'s alpha.
    """

    label = "concept projection (robust norms)"

    def __init__(self, lens: AttachedModel, direction: Tensor, site: str, mean: Tensor | None = None) -> None:
        from conceptlens.steering.units import robust_norm

        direction = torch.as_tensor(direction).detach().double().reshape(-1)
        if not direction.norm() > 0:
            raise ValueError("ConceptExpression needs a direction of nonzero norm")
        self.lens, self.site = lens, lens.site(site).name
        self.unit = direction / direction.norm()
        self.offset = 0.0 if mean is None else float(torch.as_tensor(mean).double() @ self.unit)
        self.norm = robust_norm(lens, self.site)

    @torch.no_grad()
    def __call__(self, generation: Generation) -> float:
        if not len(generation.tokens):
            return math.nan
        batch, (start,) = _joined(self.lens.tokenizer, [generation])
        device = input_device(self.lens.model)
        with self.lens.capture(self.site) as capture:
            acts, _ = capture.forward(**{k: v.to(device) for k, v in batch.items()})
        new = acts[self.site].flatten(1)[start:].double().cpu()  # (T, d) -> the continuation's tokens
        return float(((new @ self.unit) - self.offset).mean() / self.norm)
