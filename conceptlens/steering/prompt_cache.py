"""One unsteered forward of a batch of prompts, reused by every steered generation of them and
by the unsteered model's reading of every continuation.

    prompts = PromptCache(model, tokenizer, ["The weather this morning was", ...])
    with lens.steer(RowsAdd(directions, len(prompts.prompts), alpha, ...), positions="generated"):
        generations = prompts.generate(model, tokenizer, copies=len(directions), max_new_tokens=12)
    prompts.perplexity(model, generations)      # == continuation_perplexity(model, tokenizer, generations)

With `positions="generated"` no edit touches the prompt, so its keys and values are the same for
every direction and alpha: each generation starts from a copy of the cache (every position but
the last, which `generate` must run itself, and which the scope counts as prompt because the
attention mask covers the whole prompt). Perplexity reads the continuations after the full
cached prompt: the first new token's log-probability is the prompt's last logits, the others one
forward over the continuations. Batch row b holds prompt b % n (`copies` tiles of the prompts).
"""

from __future__ import annotations

import copy
import inspect
import math
from typing import Any, Sequence

import torch
from torch import Tensor

from conceptlens.batching import pad_right
from conceptlens.devices import input_device
from conceptlens.steering import sweep_scores
from conceptlens.steering.sweep_scores import Generation


class PromptCache:
    """The left-padded prompts, their unsteered KV cache and their last next-token log-probabilities."""

    @torch.no_grad()
    def __init__(self, model: Any, tokenizer: Any, prompts: Sequence[str]) -> None:
        from conceptlens.steering.sweep import _left_padded

        if isinstance(prompts, str) or not prompts:
            raise ValueError(f"prompts must be a non-empty list of strings; got {prompts!r}")
        self.prompts = list(prompts)
        self.batch = _left_padded(tokenizer, self.prompts)
        device = input_device(model)
        positions = (self.batch["attention_mask"].cumsum(1) - 1).clamp_min(0)  # as generate counts them
        out = model(**{k: v.to(device) for k, v in self.batch.items()}, position_ids=positions.to(device),
                    use_cache=True, **_last_logits_only(model))
        self.cache = out.cache
        self.last = out.logits[:, -1].double().log_softmax(-1).cpu()  # (n, V)
        self._unsteered: dict[str, list[Generation]] = {}

    def tiled(self, copies: int, drop: int = 0) -> Any:
        """A fresh copy of the cache for `copies` tiles of the prompts, less its last `drop` positions."""
        return self._rows(torch.arange(len(self.prompts)).repeat(copies), drop)

    def _rows(self, rows: Tensor, drop: int = 0) -> Any:
        """A fresh copy of the cache whose batch row i holds prompt `rows[i]`, less its last `drop` positions."""
        cache = copy.deepcopy(self.cache)
        if drop:
            cache.crop(-drop)
        cache.batch_select_indices(rows.to(self.last.device))
        return cache

    def generate(self, model: Any, tokenizer: Any, copies: int, **kwargs: Any) -> list[Generation]:
        """Greedy (unless `kwargs` say otherwise) continuations of `copies` tiles of the prompts,
        as `sweep._generate` gives them without the cache; inside a steering scope they are steered."""
        from conceptlens.steering.sweep import _generate

        batch = {k: v.repeat(copies, 1) for k, v in self.batch.items()}
        # one-token prompts leave no position to reuse (a cache cropped to nothing keeps its batch size)
        cache = {"cache": self.tiled(copies, drop=1)} if batch["input_ids"].shape[1] > 1 else {}
        return _generate(model, tokenizer, batch, self.prompts * copies, {"do_sample": False, **kwargs, **cache},
                         logits=False)

    def unsteered(self, model: Any, tokenizer: Any, **kwargs: Any) -> list[Generation]:
        """The unsteered continuations, generated once per `kwargs` and kept."""
        key = repr(sorted(kwargs.items()))
        if key not in self._unsteered:
            self._unsteered[key] = self.generate(model, tokenizer, 1, **kwargs)
        return self._unsteered[key]

    @torch.no_grad()
    def perplexity(self, model: Any, generations: Sequence[Generation], chunk: int = 256) -> Tensor:
        """(B,) float64 perplexity of each continuation given its prompt under `model` (nan for an
        empty one): `sweep_scores.continuation_perplexity` read after the cached prompt (its logits
        `chunk` tokens at a time)."""
        n = len(self.prompts)
        if len(generations) % n:
            raise ValueError(f"{len(generations)} generations are not whole tiles of the {n} prompts")
        rows = torch.arange(n).repeat(len(generations) // n)
        lengths = torch.tensor([len(g.tokens) for g in generations], dtype=torch.long)
        total = torch.zeros(len(generations), dtype=torch.float64)
        some = lengths > 0
        firsts = torch.tensor([int(g.tokens[0]) if len(g.tokens) else 0 for g in generations])
        total[some] = self.last[rows, firsts][some]
        if int(lengths.max()) > 1:
            total += self._rest(model, generations, rows, chunk)
        out = torch.full((len(generations),), math.nan, dtype=torch.float64)
        out[some] = torch.exp(-total[some] / lengths[some].double())
        return out

    def _rest(self, model: Any, generations: Sequence[Generation], rows: Tensor, chunk: int = 256) -> Tensor:
        """(B,) summed log-probabilities of each continuation's tokens after its first: forwards of the
        continuations (right-padded) after the cached prompts (row b's prompt is `rows[b]`), as many rows
        at a time as fit `sweep_scores.LOGITS_BYTES` of logits, one at least (Gemma-3's 262,144-token
        vocabulary made 1.2 GB for 100 continuations), each read `chunk` tokens at a time in float64
        (all at once, 288 continuations of 12 tokens made 1.8 GB of copies). A row's logits do not
        depend on the others."""
        device = input_device(model)
        feed = pad_right([g.tokens[:-1].tolist() for g in generations])  # token i predicts token i + 1
        prompt_mask = self.batch["attention_mask"][rows]
        mask = torch.cat([prompt_mask, feed["attention_mask"]], 1)
        positions = prompt_mask.sum(1, keepdim=True) + torch.arange(feed["input_ids"].shape[1])
        targets = pad_right([g.tokens[1:].tolist() for g in generations])["input_ids"]
        b, m = feed["input_ids"].shape
        per = sweep_scores.forward_rows(b, m, sweep_scores.vocab_size(model))
        total = torch.zeros(b, dtype=torch.float64)
        for first in range(0, b, per):
            part = slice(first, min(b, first + per))
            logits = model(input_ids=feed["input_ids"][part].to(device), attention_mask=mask[part].to(device),
                           position_ids=positions[part].to(device), cache=self._rows(rows[part]),
                           use_cache=True).logits  # (rows, m, V)
            row, step = feed["attention_mask"][part].nonzero(as_tuple=True)  # each real token of the part
            read, wanted = sweep_scores.logit_rows(chunk, logits.shape[-1]), targets[part]
            scored = [sweep_scores._target_logprobs(logits[r.to(device), s.to(device)], wanted[r, s])
                      for r, s in zip(row.split(read), step.split(read))]
            total[part].index_add_(0, row, torch.cat(scored or [torch.zeros(0, dtype=torch.float64)]))  # a view
            del logits
        return total


def _last_logits_only(model: Any) -> dict[str, int]:
    """`logits_to_keep=1` where the model's forward takes it (HF's causal LMs): the prompts' forward
    needs only the last position's logits, and all of them are (n, T, V) floats (Gemma-3's
    262,144-token vocabulary made 170 MB for the steering part's 16 prompts)."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
