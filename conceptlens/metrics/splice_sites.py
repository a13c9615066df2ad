"""CE-loss recovered for dictionaries that read and write several sites (transcoders, crosscoders,
cross-layer transcoders): `splice.py`'s measure, with the model's own activations replaced at the
targets by what the dictionary predicts.

    r = splice_replacement(lens, ["blocks.3.mlp.in"], ["blocks.3.mlp_out"], tc, batches)      # a transcoder
    r = splice_replacement(lens, ins, outs, clt, batches)                                     # a CLT: every target at once
    per_site = splice_crosscoder(lens, sites, cc, batches)                                    # {site: SpliceResult}

A replacement is causal: in one forward, the input sites are read as they run (so a target's
replacement changes the inputs of later layers, as in the replacement model of Circuit Tracing)
and each target is replaced by the dictionary's prediction from the inputs read so far (inputs
not reached yet are zeros; a transcoder's or a CLT's target depends only on earlier inputs). The
baseline zeroes every target. A crosscoder is acausal (it reads later sites too), so each site is
measured alone: the crosscoder encodes the clean forward's activations at all its sites, and one
forward replaces that site's rows by their reconstruction (baseline: that site zeroed). Rows are
those of `splice.splice_mask` (real tokens, without each sequence's first by default).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from conceptlens.concepts import registry
from conceptlens.devices import input_device
from conceptlens.metrics.faithfulness import next_token_loss_sum
from conceptlens.metrics.quality import ce_loss_recovered
from conceptlens.metrics.splice import SpliceResult, _check_model, _replacer, splice_mask

if TYPE_CHECKING:
    from conceptlens.interface import AttachedModel

Batches = Mapping[str, Tensor] | Iterable[Mapping[str, Tensor]]
Hooks = dict[str, Callable[[Tensor], Tensor | None]]


def _predictor(model: Any, n_inputs: int) -> Callable[[list[Tensor]], list[Tensor]]:
    """inputs -> predicted targets, for a transcoder (one input) or anything whose reconstruct takes a list."""
    if n_inputs == 1 and getattr(model, "method", "") in registry.names(rows="pair", concepts="decoder"):
        return lambda xs: [model.reconstruct(xs[0])]
    return lambda xs: list(model.reconstruct(xs))


def _loss(lens: AttachedModel, batch: dict[str, Tensor], hooks: Hooks) -> tuple[float, int]:
    handles = [lens.hook(site, fn) for site, fn in hooks.items()]
    try:
        logits = lens.model(**batch).logits
    finally:
        for h in handles:
            h.remove()
    total, n = next_token_loss_sum(logits, batch["input_ids"], batch["attention_mask"])
    return float(total), int(n)


def _width(lens: AttachedModel, site: str) -> int:
    shape = lens.site(site).shape
    if not isinstance(shape[-1], int):
        raise ValueError(f"site {site!r} has no fixed width (shape {shape}); it cannot be an input of a replacement")
    return shape[-1]


def _moved(new: Tensor) -> Callable[[Tensor], Tensor]:
    """A reconstruction `new` of the rows, on their device."""
    return lambda rows: new.to(rows.device)


def _prepared(lens: AttachedModel, batches: Batches) -> Iterable[dict[str, Tensor]]:
    device = input_device(lens.model)
    for batch in [batches] if isinstance(batches, Mapping) else batches:
        batch = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}
        if batch.get("attention_mask") is None:
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        yield batch


def _result(totals: Tensor, count: int) -> SpliceResult:
    if count == 0:
        raise ValueError("the batches hold no next-token prediction between two real tokens")
    clean, spliced, zero = (totals / count).tolist()
    return SpliceResult(clean, spliced, zero, ce_loss_recovered(clean, spliced, zero), count)


@torch.no_grad()
def splice_replacement(lens: AttachedModel, inputs: Sequence[str], targets: Sequence[str], model: Any, batches: Batches,
                       *, skip_first: bool = True) -> SpliceResult:
    """Next-token loss clean, with every target replaced (causally, see the module docstring) and
    with every target zeroed. `model`: a transcoder (one input, one target) or a cross-layer
    transcoder (its `reconstruct` maps the list of inputs to the list of targets)."""
    _check_model(lens)
    ins, outs = [lens.site(s).name for s in inputs], [lens.site(s).name for s in targets]
    if set(ins) & set(outs):
        raise ValueError(f"a replacement's inputs and targets must be distinct sites; both hold {set(ins) & set(outs)}")
    predict, widths = _predictor(model, len(ins)), [_width(lens, s) for s in ins]
    totals, count = torch.zeros(3, dtype=torch.float64), 0
    for batch in _prepared(lens, batches):
        where = splice_mask(batch["attention_mask"], skip_first)
        read: dict[str, Tensor] = {}

        def record(site: str) -> Callable[[Tensor], None]:
            def fn(x: Tensor) -> None:
                read[site] = x[where.to(x.device)].flatten(1).float()
            return fn

        def predicted(j: int) -> Callable[[Tensor], Tensor]:
            def fn(rows: Tensor) -> Tensor:
                xs = [read[s].to(rows.device) if s in read else rows.new_zeros(rows.shape[0], w)
                      for s, w in zip(ins, widths)]
                return predict(xs)[j]
            return fn

        replaced: Hooks = {s: record(s) for s in ins} | {s: _replacer(predicted(j), where) for j, s in enumerate(outs)}
        runs: tuple[Hooks, ...] = ({}, replaced, {s: _replacer(torch.zeros_like, where) for s in outs})
        for i, run in enumerate(runs):
            read.clear()
            total, n = _loss(lens, batch, run)
            totals[i] += total
        count += n
    return _result(totals, count)


@torch.no_grad()
def splice_crosscoder(lens: AttachedModel, sites: Sequence[str], model: Any, batches: Batches,
                      *, skip_first: bool = True) -> dict[str, SpliceResult]:
    """Per site: next-token loss clean, with that site's rows replaced by the crosscoder's
    reconstruction from the clean activations at every site, and with that site zeroed."""
    _check_model(lens)
    names = [lens.site(s).name for s in sites]
    totals, count = torch.zeros(len(names), 3, dtype=torch.float64), 0
    for batch in _prepared(lens, batches):
        where = splice_mask(batch["attention_mask"], skip_first)
        with lens.capture(names, keep_shape=True) as cap:
            acts, _ = cap.forward(**batch)
        recon = model.reconstruct(*[acts[s][where.to(acts[s].device)].flatten(1).float() for s in names])
        clean, n = _loss(lens, batch, {})
        totals[:, 0] += clean
        count += n
        for j, site in enumerate(names):
            spliced = _replacer(_moved(recon[j]), where)
            totals[j, 1] += _loss(lens, batch, {site: spliced})[0]
            totals[j, 2] += _loss(lens, batch, {site: _replacer(torch.zeros_like, where)})[0]
    return {site: _result(totals[j], count) for j, site in enumerate(names)}
