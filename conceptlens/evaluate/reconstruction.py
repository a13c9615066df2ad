"""Reconstruction on held-out text: FVU, CE-loss recovered, KL to the clean model, dead and dense latents.

    lines = reconstruction_lines(lens, "blocks.15.resid_out", {"topk": enc}, batches, site_mean)

Each batch runs clean (recording the site), then once per set with its reconstruction spliced
in at the site (`metrics.splice`'s replacement: real tokens but each sequence's first), once
zero-ablated and once mean-ablated (the site's mean over train text). Per document it sums the
next-token cross-entropy, the KL divergence KL(clean || edited) of the next-token distributions
(nats per predicted token) and, on the replaced rows, the squared error, the squared norm, the
row sum and how often each latent fired. Intervals: bootstrap over the documents.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from conceptlens.devices import input_device
from conceptlens.evaluate.activations import ConceptEncoder
from conceptlens.evaluate.bootstrap import Estimate, bootstrap
from conceptlens.evaluate.lines import Line
from conceptlens.interface import AttachedModel
from conceptlens.metrics.splice import _check_model, _replacer, predicts_next_token, splice_mask
from conceptlens.steering.sweep_scores import forward_rows, logit_rows, vocab_size

DENSE = 0.1
"""A latent is dense when it fires on more than this fraction of tokens."""

NONE = Estimate(math.nan, math.nan, math.nan)


def next_token_terms(logits: Tensor, clean: Tensor, ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per sequence `(B,)`: summed next-token cross-entropy under `logits` `(B, T, V)`, summed
    KL(softmax(clean) || softmax(logits)), and the number of predicted tokens (a token counts when
    it and its predecessor are real)."""
    valid = (mask[:, 1:] & mask[:, :-1]).bool()  # (B, T-1)
    ce, kl = (torch.zeros(len(ids), dtype=torch.float64, device=logits.device) for _ in range(2))  # summed where
    # predictions per float64 (n, V) slice, as the perplexities read logits (`sweep_scores.CHUNK_BYTES`): one
    # slice for SmolLM2's 49,152-token vocabulary at 128 tokens, 32 predictions for Gemma-3's 262,144
    step = logit_rows(logits.shape[1], logits.shape[-1])
    for b in range(len(ids)):  # one sequence at a time, in slices of its predictions: not (B, T, V) float64
        at = valid[b].nonzero().flatten()  # positions whose next token is predicted
        for part in at.split(step):
            logp = F.log_softmax(logits[b, part].double(), -1)  # (n, V)
            clean_logp = F.log_softmax(clean[b, part].double(), -1)
            ce[b] -= logp.gather(-1, ids[b, part + 1, None]).sum()
            kl[b] += (clean_logp.exp() * (clean_logp - logp)).sum()
    return ce.cpu(), kl.cpu(), valid.sum(1).double().cpu()


@torch.no_grad()
def splice_terms(lens: AttachedModel, site: str, edits: Mapping[str, Callable[[Tensor], Tensor]],
                 batches: Iterable[Mapping[str, Tensor]], on_rows: Callable[[Tensor, Tensor], None] | None = None
                 ) -> dict[str, Tensor]:
    """Per document: `"clean"` `(D, 2)` (CE sum, predicted tokens) and, per edit, `(D, 2)` (CE sum,
    KL sum) with the site's replaced rows set to `edit(rows)`; `on_rows(x, doc)` sees the clean
    replaced rows `(N, d)` and their document ids."""
    _check_model(lens)
    name = lens.site(site).name
    device = input_device(lens.model)
    out: dict[str, list[Tensor]] = {key: [] for key in ("clean", *edits)}
    offset = 0
    for batch in _row_slices(batches, vocab_size(lens.model)):
        batch = {k: v.to(device) for k, v in batch.items()}
        ids = batch["input_ids"]
        mask = batch.get("attention_mask", torch.ones_like(ids))
        where = splice_mask(mask)
        seen: list[Tensor] = []
        with lens.hook(name, lambda x: seen.append(x[where.to(x.device)].flatten(1).float().cpu())):
            clean = lens.model(**batch).logits
        if on_rows is not None:
            on_rows(seen[0], where.nonzero()[:, 0].cpu() + offset)
        ce, _, n = next_token_terms(clean, clean, ids, mask)
        out["clean"].append(torch.stack([ce, n], 1).cpu())
        for key, edit in edits.items():
            with lens.hook(name, _replacer(edit, where)):
                logits = lens.model(**batch).logits
            ce, kl, _ = next_token_terms(logits, clean, ids, mask)
            out[key].append(torch.stack([ce, kl], 1).cpu())
        offset += len(ids)
    return {key: torch.cat(v) for key, v in out.items()}


def _row_slices(batches: Iterable[Mapping[str, Tensor]], vocab: int | None) -> Iterable[Mapping[str, Tensor]]:
    """Each batch, or consecutive slices of its rows (every tensor cut along its first dimension)
    whose float32 logits fit in `sweep_scores.LOGITS_BYTES` (the clean ones stay alive through every
    edit); a sequence's logits do not depend on the other rows."""
    for batch in batches:
        rows, length = batch["input_ids"].shape
        step = forward_rows(rows, length, vocab)
        for start in range(0, rows, step):  # one slice, the whole batch, when its logits fit
            yield {k: v[start:start + step] for k, v in batch.items()}


class RowStats:
    """Per-document sums over replaced rows for one set: squared error, squared norm, row count,
    row sum `(d,)`, active latents, and each latent's firing count `(n,)`."""

    def __init__(self, encoder: ConceptEncoder, n_docs: int) -> None:
        if encoder.decode is None:
            raise ValueError(f"reconstruction metrics need a set that decodes; this one does not ({encoder.kind})")
        self.encoder, self.decode, self.n_docs = encoder, encoder.decode, n_docs
        self.scalars: Tensor | None = None  # (D, 4): err, sq, rows, nonzero
        self.sums: Tensor | None = None  # (D, d)
        self.fired: Tensor | None = None  # (D, n)

    def update(self, x: Tensor, doc: Tensor) -> None:
        z = self.encoder.encode(x)
        x_hat = self.decode(z)
        x = x.double()
        scalars = torch.stack([(x - x_hat.double()).pow(2).sum(1), x.pow(2).sum(1), torch.ones(len(x), dtype=x.dtype),
                               (z != 0).double().sum(1)], 1)
        parts = {"scalars": scalars, "sums": x, "fired": (z != 0).double()}
        for key, values in parts.items():
            total = getattr(self, key)
            if total is None:
                total = torch.zeros(self.n_docs, values.shape[1], dtype=torch.float64)
            setattr(self, key, total.index_add_(0, doc, values))

    def totals(self) -> tuple[Tensor, Tensor, Tensor]:
        """(scalars, sums, fired) once rows have been added."""
        if self.scalars is None or self.sums is None or self.fired is None:
            raise ValueError("no rows reached the site: the held-out batches are empty")
        return self.scalars, self.sums, self.fired


def _fvu(t: Tensor) -> Tensor:
    err, sq, n, sums = t[..., 0], t[..., 1], t[..., 2], t[..., 4:]
    return err / (sq - sums.pow(2).sum(-1) / n)


def _recovered(t: Tensor) -> Tensor:  # columns: clean CE, zero CE, edited CE
    return (t[..., 1] - t[..., 2]) / (t[..., 1] - t[..., 0])


def reconstruction_lines(lens: AttachedModel, site: str, encoders: Mapping[str, ConceptEncoder],
                         batches: Sequence[Mapping[str, Tensor]], site_mean: Tensor, seed: int = 0) -> list[Line]:
    """FVU, CE-loss recovered, KL, L0, dead and dense fractions of every set in `encoders` (all must decode);
    on an encoder, which predicts no next token, without CE-loss recovered and KL, which FVU's line
    says (an encoder-decoder is refused in one line)."""
    n_docs = sum(len(b["input_ids"]) for b in batches)
    stats = {name: RowStats(enc, n_docs) for name, enc in encoders.items()}
    if not predicts_next_token(lens.model) and not getattr(lens.model.config, "is_encoder_decoder", False):
        return _row_lines(lens, site, stats, batches, seed)  # an encoder (an encoder-decoder is refused)
    edits: dict[str, Callable[[Tensor], Tensor]] = {name: (lambda s: lambda x: s.decode(s.encoder.encode(x)))(s)
                                                    for name, s in stats.items()}
    edits |= {" zero": torch.zeros_like, " mean": lambda x: site_mean.to(x).expand_as(x)}

    def on_rows(x: Tensor, doc: Tensor) -> None:
        for s in stats.values():
            s.update(x, doc)

    terms = splice_terms(lens, site, edits, batches, on_rows)
    clean, tokens = terms["clean"][:, :1], terms["clean"][:, 1:]

    def ce(key: str) -> Tensor:  # (D, 3): clean, zero, edited CE sums
        return torch.cat([clean, terms[" zero"][:, :1], terms[key][:, :1]], 1)

    def kl(key: str) -> Estimate:
        return bootstrap(torch.cat([terms[key][:, 1:], tokens], 1), lambda t: t[..., 0] / t[..., 1], seed=seed)

    mean_rec, zero_kl, mean_kl = bootstrap(ce(" mean"), _recovered, seed=seed), kl(" zero"), kl(" mean")
    clean_ce = float(clean.sum() / tokens.sum())
    lines = []
    for name, s in stats.items():
        spliced_ce = float(terms[name][:, 0].sum() / tokens.sum())
        fvu, *sparsity = _stat_lines(name, s, seed)
        lines += [
            fvu,
            Line(name, "CE loss recovered", bootstrap(ce(name), _recovered, seed=seed),
                 [("mean-ablation", mean_rec), ("zero-ablation", Estimate(0.0, math.nan, math.nan))],
                 f"clean {clean_ce:.3f}, spliced {spliced_ce:.3f} nats/token over {int(tokens.sum()):,} predictions"),
            Line(name, "KL to clean (nats/token)", kl(name), [("mean-ablation", mean_kl), ("zero-ablation", zero_kl)],
                 "KL(clean, spliced) of the next-token distributions", higher_is_better=False),
            *sparsity]
    return lines


def _row_lines(lens: AttachedModel, site: str, stats: Mapping[str, RowStats],
               batches: Sequence[Mapping[str, Tensor]], seed: int) -> list[Line]:
    """FVU, L0, dead and dense fractions from the site's rows alone (the first token of each sequence
    left out, as the splice leaves it): a model that predicts no next token has no CE or KL to give."""
    from conceptlens.evaluate.activations import collect

    def on_rows(x: Tensor, doc: Tensor) -> None:
        for s in stats.values():
            s.update(x, doc)

    collect(lens, site, {}, ((dict(b), torch.zeros(len(b["input_ids"]))) for b in batches), on_rows)
    why = f"; no CE loss recovered or KL: {type(lens.model).__name__} is an encoder, it predicts no next token"
    return [line._replace(note=line.note + why) if line.metric == "FVU" else line
            for name, s in stats.items() for line in _stat_lines(name, s, seed)]


def _stat_lines(name: str, s: RowStats, seed: int) -> list[Line]:
    """FVU, L0, dead and dense fractions of one set's held-out rows."""
    scalars, sums, fired = s.totals()
    rows = scalars[:, 2:3]
    per_latent = torch.cat([fired, rows], 1)
    return [
        Line(name, "FVU", bootstrap(torch.cat([scalars, sums], 1), _fvu, seed=seed),
             [("mean predictor", Estimate(1.0, math.nan, math.nan))], f"{int(rows.sum()):,} held-out tokens",
             higher_is_better=False),
        Line(name, "L0", bootstrap(scalars[:, [3, 2]], lambda t: t[..., 0] / t[..., 1], seed=seed), [],
             "active latents per token"),
        Line(name, "dead fraction", Estimate(float((fired.sum(0) == 0).double().mean()), math.nan, math.nan), [],
             f"latents that never fired on the {int(rows.sum()):,} held-out tokens (a count that falls with more "
             "tokens: each token fires only L0 of them); no interval: a resample holds fewer distinct documents, "
             "so it counts more latents unseen", higher_is_better=False),
        Line(name, f"dense fraction (>{DENSE:.0%} of tokens)",
             bootstrap(per_latent, lambda t: (t[..., :-1] > DENSE * t[..., -1:]).double().mean(-1), seed=seed),
             [], "", higher_is_better=False)]
