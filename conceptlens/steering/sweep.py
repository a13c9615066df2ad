"""Dose-response sweeps: how a score of the generated text moves with the steering strength.

    from conceptlens.steering import Add, sweep, token_logprob
    result = sweep(lens, lambda a: Add(cs[12], alpha=a), [0, 10, 20, 40], prompts,
                   token_logprob(tokenizer, " wedding"), max_new_tokens=16, plot="wedding.png")
    print(result.table())                  # alpha, score mean +- std, perplexity, one text

For every alpha, all prompts are generated in one greedy batch inside one
`lens.steer(make_edit(alpha), positions=...)` scope; `score(generation)` turns each
prompt's `Generation` (its new tokens, the raw logits of every step and the decoded text)
into one float. Next to the score, `fluency=True` (default) measures each continuation's
perplexity under the unsteered model (`sweep_scores.continuation_perplexity`): the alpha to
pick is one that moves the score while the perplexity stays near the unsteered one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from conceptlens._io import atomic_write
from conceptlens.steering.edits import Edit
from conceptlens.steering.scope import Positions
from conceptlens.steering.sweep_scores import continuation_perplexity

if TYPE_CHECKING:
    from conceptlens.lens import Lens


class Generation(NamedTuple):
    """One prompt's continuation, as a score function sees it."""

    prompt: str
    text: str
    """The decoded new tokens (special tokens skipped)."""
    tokens: Tensor
    """(n,) new token ids, up to and including the first end-of-sequence token."""
    logits: Tensor
    """(n, V) raw logits of each step: row i is the distribution `tokens[i]` was chosen from."""


Score = Callable[[Generation], float]


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

    def table(self) -> str:
        """One line per alpha: score mean +- std over prompts, median perplexity, prompt 0's continuation."""
        ppl = self.median_perplexity
        lines = [f"{'alpha':>8}  {self.label:>16}{'  perplexity' if ppl is not None else ''}  continuation of prompt 0"]
        for a, (alpha, mean, std, texts) in enumerate(zip(self.alphas, self.mean.tolist(), self.std.tolist(),
                                                          self.texts)):
            fluency = f"  {float(ppl[a]):10.2f}" if ppl is not None else ""
            lines.append(f"{alpha:8.2f}  {mean:9.3f} +- {std:<5.3f}{fluency}  {texts[0]!r}")
        return "\n".join(lines)


class TokenLogProb:
    """Score: mean log-probability of a word's first token over the generated steps.

        score = TokenLogProb(tokenizer, " wedding")      # or token_logprob(tokenizer, " wedding")

    With `positions="generated"` the first step's logits come from the (unsteered) prompt,
    so an edit moves this score through steps 2..n only.
    """

    def __init__(self, tokenizer: Any, word: str) -> None:
        ids = tokenizer(word, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(f"{word!r} encodes to no tokens")
        self.token_id = int(ids[0])
        self.label = f"log p({tokenizer.decode([self.token_id])!r})"

    def __call__(self, generation: Generation) -> float:
        logprobs = generation.logits.double().log_softmax(-1)[:, self.token_id]  # (n,)
        return float(logprobs.mean())


def token_logprob(tokenizer: Any, word: str) -> TokenLogProb:
    """The ready-made score: mean log-probability of `word`'s first token per generated step."""
    return TokenLogProb(tokenizer, word)


def sweep(lens: Lens, make_edit: Callable[[float], Edit], alphas: Sequence[float], prompts: Sequence[str],
          score: Score, *, positions: Positions = "generated", max_new_tokens: int = 32,
          tokenizer: Any = None, plot: str | None = None, fluency: bool = True,
          **generate_kwargs: Any) -> SweepResult:
    """Generate greedily from every prompt under `make_edit(alpha)` for each alpha and score it.

    `tokenizer` defaults to the lens's; `generate_kwargs` go to `model.generate` (greedy
    unless they say otherwise). `plot`: a .png path for the dose-response figure.
    """
    tokenizer = tokenizer if tokenizer is not None else lens.tokenizer
    if tokenizer is None:
        raise ValueError("sweep needs a tokenizer: conceptlens.attach(model, tokenizer) or tokenizer=")
    if isinstance(prompts, str) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of strings; got {prompts!r}")
    if not alphas:
        raise ValueError("alphas is empty; give the steering strengths to try, e.g. [0, 4, 8, 16]")
    batch = _left_padded(tokenizer, list(prompts))
    generate_kwargs = {"do_sample": False, "max_new_tokens": max_new_tokens, **generate_kwargs}
    scores, texts, perplexity = [], [], []
    for alpha in alphas:
        with lens.steer(make_edit(float(alpha)), positions=positions):
            generations = _generate(lens.model, tokenizer, batch, list(prompts), generate_kwargs)
        scores.append([float(score(g)) for g in generations])  # outside the scope: the unsteered model
        texts.append([g.text for g in generations])
        if fluency:
            perplexity.append(continuation_perplexity(lens.model, tokenizer, generations))
    label = getattr(score, "label", getattr(score, "__name__", "score"))
    result = SweepResult([float(a) for a in alphas], torch.tensor(scores, dtype=torch.float64), texts, label,
                         torch.stack(perplexity) if fluency else None)
    if plot is not None:
        plot_sweep(result, plot)
    return result


def _left_padded(tokenizer: Any, prompts: list[str]) -> dict[str, Tensor]:
    if len(prompts) > 1 and tokenizer.pad_token_id is None:
        raise ValueError("several prompts need a tokenizer with a pad token; "
                         "e.g. tokenizer.pad_token = tokenizer.eos_token")
    return dict(tokenizer(prompts, return_tensors="pt", padding=len(prompts) > 1, padding_side="left"))


@torch.no_grad()
def _generate(model: Any, tokenizer: Any, batch: dict[str, Tensor], prompts: list[str],
              kwargs: dict[str, Any]) -> list[Generation]:
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(**batch, output_logits=True, return_dict_in_generate=True, pad_token_id=pad, **kwargs)
    new = out.sequences[:, batch["input_ids"].shape[1]:]  # (B, n)
    logits = torch.stack(out.logits, 1).float().cpu()  # (B, n, V)
    eos = _eos_ids(model, tokenizer)
    generations = []
    for row, prompt in enumerate(prompts):
        tokens = new[row].cpu()
        hits = torch.isin(tokens, eos).nonzero()
        n = int(hits[0]) + 1 if len(hits) else len(tokens)  # after eos the row holds padding
        text = tokenizer.decode(tokens[:n], skip_special_tokens=True)
        generations.append(Generation(prompt, text, tokens[:n], logits[row, :n]))
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
    fmt = str(path).rsplit(".", 1)[-1].lower() if "." in str(path) else "png"
    atomic_write(path, lambda tmp: fig.savefig(tmp, format=fmt, dpi=120))
