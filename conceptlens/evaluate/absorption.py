"""Feature absorption, SAEBench's first-letter task on the tokenizer's own vocabulary.

    words = alpha_tokens(tok, 2000)                     # (token id, word) of whole-word alphabetic tokens
    lines = absorption_lines(lens, site, {"topk": enc}, tok, words)

Chanin et al.'s metric as SAEBench computes it (`evals/absorption`): the site's activation at
each word token (after a fixed two-line spelling prompt) trains one logistic probe per first
letter (the ground truth). Per letter, k-sparse probes on the latents for k = 1..`max_k` pick
the letter's main latents: k grows while the test F1 rises by more than `F1_JUMP` (feature
splitting). On every test word the probe calls correctly (a probe true positive), with p the
unit probe direction and each latent's probe projection z_i (d_i . p) (d_i its decoder row):

- absorption fraction: 0 when the main latents' projection reaches the word's own projection
  x . p, or when the (at most 3) largest positive projections of other latents with cos(d_i, p)
  >= 0.1 make up less than 40% of it; 1 when the main latents project <= 0; else the share of
  the absorbers' projection (capped at what the main latents leave) in absorbers + main;
- full absorption: no main latent fires, the latent with the largest projection has cos >= 0.025
  and makes up at least 40% of x . p.

Each score is summed per letter, divided by the letter's probe true positives, and averaged over
letters. Differences from SAEBench: main latents are chosen by mean difference (as in the probing
suite) rather than by an L1 probe's weights; one fixed prompt rather than 10 shuffled in-context
examples; projections use d_i . p (SAEBench assumes unit decoder rows, where the two agree).
Intervals: bootstrap over test words.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping, NamedTuple

import torch
from torch import Tensor

from conceptlens.devices import input_device
from conceptlens.evaluate.activations import ConceptEncoder
from conceptlens.evaluate.bootstrap import bootstrap
from conceptlens.evaluate.lines import Line
from conceptlens.interface import AttachedModel

PROMPT = "tree has the first letter: T\nmoon has the first letter: M\n"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
F1_JUMP = 0.03
FULL_COS, FRACTION_COS, PROPORTION, MAX_ABSORBERS = 0.025, 0.1, 0.4, 3
EPS = 1e-8


SPACE_MARKS = (" ", "\u0120", "\u2581")  # a decoded space, byte-level BPE's Ġ, SentencePiece's ▁
WORD = re.compile(r"[A-Za-z]{2,}")


MIN_WORDS = 5
"""Fewest words the part takes: a fifth of them, at least one, are the held-out test words."""


def _pieces(tok: Any) -> tuple[list[str], str | None]:
    """Each id's vocabulary string and, for a WordPiece tokenizer, its continuation prefix (`##`):
    there a word starts at every piece without it, elsewhere only at a piece with a space mark."""
    model = getattr(getattr(tok, "backend_tokenizer", None), "model", None)
    prefix = getattr(model, "continuing_subword_prefix", None) if type(model).__name__ == "WordPiece" else None
    if prefix is None and getattr(tok, "wordpiece_tokenizer", None) is not None:  # a slow BERT tokenizer
        prefix = "##"
    if hasattr(tok, "convert_ids_to_tokens"):
        return list(tok.convert_ids_to_tokens(list(range(len(tok))))), prefix
    return [tok.decode([i]) for i in range(len(tok))], prefix


def whole_word(piece: str, prefix: str | None) -> str | None:
    """The word of a vocabulary piece that is a whole word of two or more ASCII letters, else None:
    after a space mark (`SPACE_MARKS`), or, in WordPiece (`prefix` given), any piece not starting
    with the continuation prefix."""
    if piece[:1] and piece[0] in SPACE_MARKS:
        word = piece[1:]
    elif prefix is not None and not piece.startswith(prefix):
        word = piece
    else:
        return None
    return word if WORD.fullmatch(word) else None


def alpha_tokens(tok: Any, limit: int, seed: int = 0) -> list[tuple[int, str]]:
    """Up to `limit` (token id, word) pairs, drawn with `seed`, of vocabulary tokens that are whole
    words of two or more ASCII letters (`whole_word`)."""
    pieces, prefix = _pieces(tok)
    found = [(i, word) for i, piece in enumerate(pieces) if (word := whole_word(piece, prefix)) is not None]
    if not found:
        looked = (f"WordPiece pieces without the {prefix!r} prefix" if prefix is not None
                  else "pieces of a space mark (' ', 'Ġ' or '▁')")
        name = getattr(tok, "name_or_path", "") or type(tok).__name__
        raise ValueError(f"absorption: no whole-word tokens in the vocabulary of {name} ({len(pieces)} tokens; "
                         f"looked for {looked} followed by two or more ASCII letters)")
    order = torch.randperm(len(found), generator=torch.Generator().manual_seed(seed))[:limit]
    return [found[i] for i in sorted(order.tolist())]


@torch.no_grad()
def word_activations(lens: AttachedModel, site: str, tok: Any, ids: list[int], batch_size: int = 64) -> Tensor:
    """`(N, d)` activations at `site` of each token id placed after `PROMPT`."""
    prefix = tok(PROMPT, add_special_tokens=True)["input_ids"]
    device = input_device(lens.model)
    out = []
    with lens.capture(site) as cap:
        for i in range(0, len(ids), batch_size):
            batch = torch.tensor([prefix + [w] for w in ids[i:i + batch_size]], device=device)
            acts, meta = cap.forward(input_ids=batch, attention_mask=torch.ones_like(batch))
            out.append(acts[site].flatten(1).cpu()[meta.position.cpu() == len(prefix)])
    return torch.cat(out)


class LetterProbe(NamedTuple):
    direction: Tensor
    """`(d,)` weights in activation space"""
    bias: float

    def scores(self, x: Tensor) -> Tensor:
        return x.double() @ self.direction + self.bias


def letter_probe(x: Tensor, y: Tensor) -> LetterProbe:
    """A logistic probe (balanced 0/1 labels by class weight) mapped back to raw activations."""
    from sklearn.linear_model import LogisticRegression

    mean, scale = x.double().mean(0), x.double().std(0).clamp_min(1e-12)
    model = LogisticRegression(max_iter=1000, class_weight="balanced").fit(((x - mean) / scale).numpy(), y.numpy())
    w = torch.from_numpy(model.coef_[0]) / scale
    return LetterProbe(w, float(model.intercept_[0] - w @ mean))


def _f1(pred: Tensor, y: Tensor) -> float:
    tp = float((pred & (y == 1)).sum())
    return 2 * tp / max(float(pred.sum() + (y == 1).sum()), 1.0)


def main_latents(z_train: Tensor, y_train: Tensor, z_test: Tensor, y_test: Tensor, max_k: int = 10) -> list[int]:
    """The letter's main latents: the top-k by mean difference (class 1 minus class 0), k growing
    from 1 while the k-sparse probe's test F1 rises by more than `F1_JUMP`."""
    from sklearn.linear_model import LogisticRegression

    order = (z_train[y_train == 1].double().mean(0) - z_train[y_train == 0].double().mean(0)).argsort(descending=True)
    best, chosen = -math.inf, []
    for k in range(1, min(max_k, z_train.shape[1]) + 1):
        feats = order[:k]
        model = LogisticRegression(max_iter=500, class_weight="balanced").fit(z_train[:, feats].double().numpy(),
                                                                             y_train.numpy())
        f1 = _f1(torch.from_numpy(model.predict(z_test[:, feats].double().numpy())) == 1, y_test)
        if f1 <= best + F1_JUMP:
            break
        best, chosen = f1, feats.tolist()
    return chosen


class Absorption(NamedTuple):
    fraction: Tensor
    """`(N,)` absorption fraction per word"""
    full: Tensor
    """`(N,)` bool: full absorption by one latent"""
    top: Tensor
    """`(N,)` the latent with the largest probe projection"""


def absorption(x: Tensor, z: Tensor, decoder: Tensor, direction: Tensor, main: list[int]) -> Absorption:
    """SAEBench's absorption fraction and full absorption of words `x` `(N, d)` with latents `z`
    `(N, n)`, decoder rows `(n, d)`, probe direction `(d,)` and the letter's main latents."""
    p = direction.double() / direction.double().norm()
    dec = decoder.double()
    cos = dec @ p / dec.norm(dim=1).clamp_min(1e-12)  # (n,)
    proj = z.double() * (dec @ p)  # (N, n): each latent's share of the probe projection
    total = x.double() @ p  # (N,)
    is_main = torch.zeros(z.shape[1], dtype=torch.bool)
    is_main[main] = True
    main_proj = proj[:, is_main].sum(1)
    candidates = torch.where(~is_main & (cos >= FRACTION_COS) & (proj > 0), proj, torch.zeros_like(proj))
    absorbers = candidates.topk(min(MAX_ABSORBERS, z.shape[1]), dim=1).values.sum(1)
    taken = torch.minimum(absorbers, total - main_proj)
    fraction = (taken / (taken + main_proj)).clamp(0, 1)
    fraction = torch.where(main_proj <= 0, torch.ones_like(fraction), fraction)
    fraction = torch.where((main_proj >= total) | (absorbers / total < PROPORTION), torch.zeros_like(fraction), fraction)
    top = proj.argmax(1)
    top_proj = proj.gather(1, top[:, None]).squeeze(1)
    full = ((z[:, is_main] < EPS).all(1) & (cos[top] >= FULL_COS) & (total >= 0) & (top_proj / total >= PROPORTION))
    return Absorption(fraction, full, top)


def _letter_mean(column: int) -> Any:
    """Statistic over `(..., 26 * 3)` columns (fraction, full, true positives per letter): the mean
    over letters with true positives of the per-letter rate."""
    def stat(t: Tensor) -> Tensor:
        t = t.reshape(*t.shape[:-1], len(LETTERS), 3)
        rate = t[..., column] / t[..., 2]
        return rate.nanmean(-1)
    return stat


def decoder_rows(decode: Callable[[Tensor], Tensor], n: int, chunk: int = 1024) -> Tensor:
    """(n, d) what each of a set's n latents adds to the reconstruction at unit activation, decode(e_i) -
    decode(0), decoding `chunk` one-hot codes at a time (an (n, n) identity is 1 GiB at width 16,384)."""
    base = decode(torch.zeros(1, n))  # (1, d): the bias
    parts = []
    for start in range(0, n, chunk):
        latents = torch.arange(start, min(start + chunk, n))
        parts.append(decode(torch.zeros(len(latents), n).index_put_((torch.arange(len(latents)), latents),
                                                                     torch.tensor(1.0))) - base)
    return torch.cat(parts)


def absorption_lines(lens: AttachedModel, site: str, encoders: Mapping[str, ConceptEncoder], tok: Any,
                     words: list[tuple[int, str]], *, max_k: int = 10, seed: int = 0) -> list[Line]:
    """Mean absorption fraction and full-absorption rate of every set that reconstructs."""
    if len(words) < MIN_WORDS:
        raise ValueError(f"absorption needs at least {MIN_WORDS} words (a fifth of them test the letter probes); "
                         f"got {len(words)}: pass --absorption-words {MIN_WORDS} or more")
    x = word_activations(lens, site, tok, [i for i, _ in words])
    letter = torch.tensor([LETTERS.index(w[0].lower()) for _, w in words])
    test = torch.zeros(len(words), dtype=torch.bool)
    test[torch.randperm(len(words), generator=torch.Generator().manual_seed(seed))[: len(words) // 5]] = True
    probes = {c: letter_probe(x[~test], (letter[~test] == c).long()) for c in letter[~test].unique().tolist()}
    lines = []
    for name, enc in encoders.items():
        if enc.decode is None:
            raise ValueError(f"absorption needs a set that decodes; {name!r} does not ({enc.kind})")
        z = enc.encode(x)
        n = z.shape[1]
        decoder = decoder_rows(enc.decode, n)
        per_word = torch.zeros(int(test.sum()), len(LETTERS), 3, dtype=torch.float64)
        splits = []
        for c, probe in probes.items():
            y_train, y_test = (letter[~test] == c).long(), (letter[test] == c).long()
            if y_test.sum() == 0:
                continue
            main = main_latents(z[~test], y_train, z[test], y_test, max_k)
            splits.append(len(main))
            tp = (y_test == 1) & (probe.scores(x[test]) > 0)
            result = absorption(x[test][tp], z[test][tp], decoder, probe.direction, main)
            per_word[tp, c] = torch.stack([result.fraction, result.full.double(), torch.ones(int(tp.sum()))], 1)
        note = (f"{int(test.sum())} test words, {len(splits)} letters, "
                f"{sum(splits) / max(len(splits), 1):.1f} main latents per letter")
        share = "share of probe true positives"
        if per_word[..., 2].sum() == 0:  # both figures are over the true positives: none, no figure
            why = (f"; no figure: no letter probe found its letter in any of the {int(test.sum())} test words "
                   f"(probes learnt from {int((~test).sum())}; more --absorption-words)")
            note, share = note + why, share + why
        per_word = per_word.flatten(1)
        lines += [Line(name, "absorption fraction", bootstrap(per_word, _letter_mean(0), seed=seed), [], note,
                       higher_is_better=False),
                  Line(name, "full absorption rate", bootstrap(per_word, _letter_mean(1), seed=seed), [], share,
                       higher_is_better=False)]
    return lines
