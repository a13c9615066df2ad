"""Dose-response sweeps: how a score of the generated text moves with the steering strength.

    from conceptlens.steering import Add, sweep, token_logprob
    result = sweep(lens, Add(cs.centred()[12], scale="robust_norm"), [0, 0.25, 0.5, 1, 2], prompts,
                   token_logprob(tokenizer, [" wedding", " bride"]), max_new_tokens=16, plot="wedding.png")
    print(result.table())                  # alpha, score mean +- std, perplexity, one text
    result.best_alpha                      # the largest alpha within the fluency budget
    sweep(lens, vec.edits(scale="robust_norm"), ...)   # a contrastive vector: every site at once

The edits are an edit or a list of edits with a strength (`Add`, `AddKeepNorm`: each is
re-made at every alpha with `edit.at(alpha)`, keeping its scale), or a function alpha -> edit(s).
For every alpha, all prompts are generated in one greedy batch inside one
`lens.steer(*edits, positions=...)` scope; `score(generation)` turns each prompt's
`Generation` (its new tokens, the raw logits of every step and the decoded text) into one
float: the concept score. Next to it, `fluency=True` (default) measures each continuation's
perplexity under the unsteered model (`sweep_scores.continuation_perplexity`) and its share of
repeated token 3-grams (`sweep_scores.repetition`: loops read fluently by perplexity), and
`best_alpha` is the largest alpha at which at least half the continuations stay within both
budgets: perplexity at most `budget` (2x) the unsteered continuations' median (generated once
more when 0 is not among the alphas), repetition at most `REPETITION_BUDGET`. `judge` is the
hook for an external judge (an evaluation suite's concept / fluency raters): it sees every
alpha's generations at once and its numbers are kept in `SweepResult.judged`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from conceptlens._io import atomic_write
from conceptlens.devices import input_device
from conceptlens.interface import AttachedModel
from conceptlens.steering.edits import Edit
from conceptlens.steering.scope import Positions
from conceptlens.steering.sweep_scores import Generation, continuation_perplexity, repetition


Score = Callable[[Generation], float]
Judge = Callable[[Sequence[Generation]], Mapping[str, Sequence[float]]]
"""An external judge: one alpha's generations (one per prompt) -> named per-prompt scores."""
Edits = Edit | Sequence[Edit] | Callable[[float], Edit | Sequence[Edit]]
REPETITION_BUDGET = 0.5
"""A continuation is fluent only if at most this share of its token 3-grams repeat an earlier one
(or no more than the unsteered continuations' median, when that is higher)."""


class SweepResult(NamedTuple):
    """Scores of a sweep: one row per alpha, one column per prompt."""

    alphas: list[float]
    scores: Tensor
    """(A, P) float64 score of each prompt's continuation at each alpha."""
    texts: list[list[str]]
    """texts[a][p]: the continuation of prompt p at alpha a."""
    label: str
    """What the score measures (the y axis of the plot)."""
    perplexity: Tensor | None = None
    """(A, P) perplexity of each continuation under the unsteered model (None without fluency)."""
    reference: Tensor | None = None
    """(P,) perplexity of the unsteered continuations (None without fluency)."""
    budget: float = 2.0
    """Fluency budget of `best_alpha`: the most median perplexity, in multiples of the unsteered one."""
    judged: dict[str, Tensor] | None = None
    """name -> (A, P) float64 scores of the judge (None without one)."""
    repetition: Tensor | None = None
    """(A, P) share of each continuation's token 3-grams repeating an earlier one (None: not measured)."""
    reference_repetition: Tensor | None = None
    """(P,) the same of the unsteered continuations."""

    @property
    def mean(self) -> Tensor:
        """(A,) mean score over prompts."""
        return self.scores.mean(1)

    @property
    def std(self) -> Tensor:
        """(A,) population standard deviation over prompts (0 for a single prompt)."""
        return self.scores.std(1, correction=0)

    @property
    def median_perplexity(self) -> Tensor | None:
        """(A,) median perplexity over prompts (None without fluency)."""
        return None if self.perplexity is None else self.perplexity.nanquantile(0.5, dim=1)

    @property
    def fluent(self) -> list[bool] | None:
        """Per alpha: whether at least half of its (non-empty) continuations are fluent: perplexity at
        most `budget` times the unsteered median, and (where measured) repetition at most
        `REPETITION_BUDGET` or the unsteered median repetition, whichever is higher."""
        if self.perplexity is None or self.reference is None:
            return None
        ok = self.perplexity <= self.budget * float(self.reference.nanquantile(0.5))
        if self.repetition is not None:
            base = self.reference_repetition
            limit = max(REPETITION_BUDGET, float(base.nanquantile(0.5)) if base is not None and
                        bool((~base.isnan()).any()) else 0.0)
            ok &= self.repetition.nan_to_num(0.0) <= limit  # shorter than a 3-gram: nothing repeats
        scored = (~self.perplexity.isnan()).sum(1)
        return [bool(n > 0 and 2 * int(k) >= int(n)) for k, n in zip(ok.sum(1), scored)]

    @property
    def best_alpha(self) -> float | None:
        """The alpha of largest magnitude that is fluent (`fluent`) together with every alpha of its
        sign closer to 0 (a first break ends the walk: repetitive salad can read fluently again);
        None without fluency or when no alpha is."""
        ends = [a for a in (self.furthest(1.0), self.furthest(-1.0)) if a is not None]
        return max(ends, key=abs, default=None)

    def furthest(self, sign: float) -> float | None:
        """`best_alpha` among the alphas of `sign` (and 0): how far steering towards (1) or away from
        (-1) the direction stays fluent."""
        fluent = self.fluent
        if fluent is None:
            return None
        best = None
        for i in sorted((i for i, a in enumerate(self.alphas) if a * sign >= 0), key=lambda i: abs(self.alphas[i])):
            if not fluent[i]:
                break
            best = self.alphas[i]
        return best

    def table(self) -> str:
        """One line per alpha: score mean +- std over prompts, median perplexity (* within the
        budgets), median repetition, judged means, prompt 0's continuation."""
        ppl, fluent, judged = self.median_perplexity, self.fluent, self.judged or {}
        extra = "".join(f"  {name:>10}" for name in judged)
        rep = None if self.repetition is None else self.repetition.nanquantile(0.5, dim=1)
        lines = [f"{'alpha':>8}  {self.label:>16}{'  perplexity' if ppl is not None else ''}"
                 f"{'  repeats' if rep is not None else ''}{extra}  continuation of prompt 0"]
        for a, (alpha, mean, std, texts) in enumerate(zip(self.alphas, self.mean.tolist(), self.std.tolist(),
                                                          self.texts)):
            fluency = f"  {float(ppl[a]):9.2f}{'*' if fluent and fluent[a] else ' '}" if ppl is not None else ""
            fluency += f"  {float(rep[a]):7.2f}" if rep is not None else ""
            scores = "".join(f"  {float(v[a].nanmean()):10.3f}" for v in judged.values())
            lines.append(f"{alpha:8.2f}  {mean:9.3f} +- {std:<5.3f}{fluency}{scores}  {texts[0]!r}")
        return "\n".join(lines)


class TokenLogProb:
    """Score: mean over the generated steps of the log-probability of a word's first token, or
    of any of several words' first tokens (the log of their summed probabilities).

        score = TokenLogProb(tokenizer, " wedding")      # or token_logprob(tokenizer, [" wedding", " bride"])

    With `positions="generated"` the first step's logits come from the (unsteered) prompt,
    so an edit moves this score through steps 2..n only.
    """

    def __init__(self, tokenizer: Any, words: str | Sequence[str]) -> None:
        words = [words] if isinstance(words, str) else list(words)
        if not words:
            raise ValueError("token_logprob needs at least one word, e.g. [' wedding', ' bride']")
        ids = []
        for word in words:
            encoded = tokenizer(word, add_special_tokens=False)["input_ids"]
            if not encoded:
                raise ValueError(f"{word!r} encodes to no tokens")
            ids.append(int(encoded[0]))
        self.token_ids = sorted(set(ids))  # words sharing a first token count it once
        self.token_id = self.token_ids[0]
        names = ", ".join(repr(tokenizer.decode([i])) for i in self.token_ids)
        self.label = f"log p({names})" if len(self.token_ids) < 4 else f"log p({len(self.token_ids)} words)"

    def __call__(self, generation: Generation) -> float:
        logprobs = generation.logits.double().log_softmax(-1)[:, self.token_ids]  # (n, W)
        return float(logprobs.logsumexp(-1).mean())


def token_logprob(tokenizer: Any, words: str | Sequence[str]) -> TokenLogProb:
    """The ready-made score: mean log-probability per generated step of `words`' first tokens."""
    return TokenLogProb(tokenizer, words)


def sweep(lens: AttachedModel, edits: Edits, alphas: Sequence[float], prompts: Sequence[str],
          score: Score, *, positions: Positions = "generated", max_new_tokens: int = 32,
          tokenizer: Any = None, plot: str | None = None, fluency: bool = True, budget: float = 2.0,
          judge: Judge | None = None, **generate_kwargs: Any) -> SweepResult:
    """Generate greedily from every prompt under the edits at each alpha and score it.

    `tokenizer` defaults to the lens's; `generate_kwargs` go to `model.generate` (greedy
    unless they say otherwise). `plot`: a .png path for the dose-response figure.
    """
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget >= 1):
        raise ValueError(f"budget is the most perplexity in multiples of the unsteered one, at least 1; got {budget!r}")
    tokenizer = tokenizer if tokenizer is not None else lens.tokenizer
    if tokenizer is None:
        raise ValueError("sweep needs a tokenizer: conceptlens.attach(model, tokenizer) or tokenizer=")
    if isinstance(prompts, str) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of strings; got {prompts!r}")
    if not alphas:
        raise ValueError("alphas is empty; give the steering strengths to try, e.g. [0, 4, 8, 16]")
    if plot is not None:
        _figure_format(plot)  # before the sweep, which a bad name would otherwise lose
    batch = _left_padded(tokenizer, list(prompts))
    generate_kwargs = {"do_sample": False, "max_new_tokens": max_new_tokens, **generate_kwargs}
    at = _edits_at(edits)
    scores, texts, perplexity, repeats = [], [], [], []
    judged: dict[str, list[list[float]]] = {}
    for alpha in alphas:
        with lens.steer(*at(float(alpha)), positions=positions):
            generations = _generate(lens.model, tokenizer, batch, list(prompts), generate_kwargs)
        scores.append([float(score(g)) for g in generations])  # outside the scope: the unsteered model
        texts.append([g.text for g in generations])
        if fluency:
            perplexity.append(continuation_perplexity(lens.model, tokenizer, generations))
            repeats.append(repetition(generations))
        for name, values in (judge(generations) if judge is not None else {}).items():
            judged.setdefault(name, []).append([float(v) for v in values])
    reference = reference_repetition = None
    if fluency:
        zero = [i for i, a in enumerate(alphas) if float(a) == 0.0]
        if zero:
            reference, reference_repetition = perplexity[zero[0]], repeats[zero[0]]
        else:
            unsteered = _generate(lens.model, tokenizer, batch, list(prompts), generate_kwargs)
            reference, reference_repetition = continuation_perplexity(lens.model, tokenizer, unsteered), \
                repetition(unsteered)
    label = getattr(score, "label", getattr(score, "__name__", "score"))
    result = SweepResult([float(a) for a in alphas], torch.tensor(scores, dtype=torch.float64), texts, label,
                         torch.stack(perplexity) if fluency else None, reference, float(budget),
                         {k: torch.tensor(v, dtype=torch.float64) for k, v in judged.items()} if judge else None,
                         torch.stack(repeats) if fluency else None, reference_repetition)
    if plot is not None:
        plot_sweep(result, plot)
    return result


def _edits_at(edits: Edits) -> Callable[[float], list[Edit]]:
    """alpha -> the list of edits to steer with: a function's result, or each edit's `at(alpha)`."""
    if callable(edits) and not isinstance(edits, Edit):
        def made(alpha: float) -> list[Edit]:
            out = edits(alpha)
            return [out] if isinstance(out, Edit) else list(out)
        return made
    fixed = [edits] if isinstance(edits, Edit) else list(edits)
    if not fixed:
        raise ValueError("no edits to sweep; give an edit, a list of edits or a function alpha -> edits")
    scalable: list[_Scalable] = []
    for edit in fixed:
        if not isinstance(edit, _Scalable):
            raise TypeError(f"sweep varies alpha, and {type(edit).__name__} has none: give edits with a strength "
                            "(Add, AddKeepNorm) or a function alpha -> edits")
        scalable.append(edit)
    return lambda alpha: [edit.at(alpha) for edit in scalable]


@runtime_checkable
class _Scalable(Protocol):
    """An edit with a strength: `at(alpha)` is the same edit at strength alpha."""

    def at(self, alpha: float) -> Edit: ...


def _left_padded(tokenizer: Any, prompts: list[str]) -> dict[str, Tensor]:
    if len(prompts) > 1 and tokenizer.pad_token_id is None:
        raise ValueError("several prompts need a tokenizer with a pad token; "
                         "e.g. tokenizer.pad_token = tokenizer.eos_token")
    return dict(tokenizer(prompts, return_tensors="pt", padding=len(prompts) > 1, padding_side="left"))


@torch.no_grad()
def _generate(model: Any, tokenizer: Any, batch: dict[str, Tensor], prompts: list[str],
              kwargs: dict[str, Any], logits: bool = True) -> list[Generation]:
    """Greedy (unless `kwargs` say otherwise) continuations; `logits=False` keeps (n, 0) logits."""
    device = input_device(model)
    batch = {k: v.to(device) for k, v in batch.items()}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(**batch, output_logits=logits, return_dict_in_generate=True, pad_token_id=pad, **kwargs)
    new = out.sequences[:, batch["input_ids"].shape[1]:]  # (B, n)
    kept = torch.stack(out.logits, 1).float().cpu() if logits else torch.zeros(*new.shape, 0)  # (B, n, V)
    eos = _eos_ids(model, tokenizer)
    generations = []
    for row, prompt in enumerate(prompts):
        tokens = new[row].cpu()
        hits = torch.isin(tokens, eos).nonzero()
        n = int(hits[0]) + 1 if len(hits) else len(tokens)  # after eos the row holds padding
        text = tokenizer.decode(tokens[:n], skip_special_tokens=True)
        generations.append(Generation(prompt, text, tokens[:n], kept[row, :n]))
    return generations


def _eos_ids(model: Any, tokenizer: Any) -> Tensor:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
    return torch.tensor([i for i in {*ids, tokenizer.eos_token_id} if i is not None], dtype=torch.long)


def plot_sweep(result: SweepResult, path: str, title: str | None = None) -> None:
    """Save the dose-response figure: each prompt faintly, the mean with a +- std band."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, Agg canvas

    alphas = result.alphas
    mean, std = result.mean.numpy(), result.std.numpy()
    fig = Figure(figsize=(5, 3.5), layout="constrained")
    ax = fig.add_subplot()
    for column in result.scores.T.numpy():
        ax.plot(alphas, column, color="0.6", linewidth=0.8, alpha=0.6)
    ax.fill_between(alphas, mean - std, mean + std, color="C0", alpha=0.25, linewidth=0)
    ax.plot(alphas, mean, "o-", color="C0", label=f"mean over {result.scores.shape[1]} prompts (+- std)")
    ax.set_xlabel("alpha")
    ax.set_ylabel(result.label)
    ax.set_title(title or f"{result.label} vs steering strength")
    ax.legend(loc="best", fontsize="small")
    fmt = _figure_format(path)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format=fmt, dpi=120))


def _figure_format(path: str | os.PathLike) -> str:
    """The format a figure at `path` is saved in (its suffix); a ValueError naming the valid ones."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    formats = FigureCanvasAgg.get_supported_filetypes()
    fmt = Path(path).suffix.lower().lstrip(".")
    if fmt not in formats:
        raise ValueError(f"cannot save a figure as {str(path)!r}: end its name in one of "
                         f"{', '.join('.' + f for f in sorted(formats))}")
    return fmt
