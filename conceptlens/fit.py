"""The streaming fit loop: texts -> batches -> capture -> extractors, with checkpoints.

    report = lens.fit({"blocks.15.resid_out": StreamingKMeans(n_concepts=64)}, "bbc-news",
                      max_tokens=200_000, checkpoint_dir="runs/km", checkpoint_every=50_000)
    report.concepts["blocks.15.resid_out"]     # ConceptSet
    lens.fit({"blocks.15.resid_out": {"km": StreamingKMeans(64), "topk": TopKSAE(width=4608, k=32)}}, ...)
    report.concepts["topk"]                    # several named extractors read one site
    lens.fit(..., max_tokens=200_000, extractor_tokens={"topk": 50_000})   # topk: until the batch reaching 50k

One capture-only forward per batch feeds every extractor at every site and stops after
the deepest site needed. Every `checkpoint_every` tokens the extractor states, the row
filter, the RNG states and the data position are written atomically; a fit started
again with `resume=True` continues from there and ends bit-identical (on CPU) to a fit
that was never interrupted.
"""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from contextlib import ExitStack, nullcontext
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Iterator, Mapping, NamedTuple

import torch
from torch import Tensor

from conceptlens import interrupts, runlock
from conceptlens.batching import check_max_length, encode_batch
from conceptlens.checkpoint import CHECKPOINT, FitState, fit_fingerprint
from conceptlens.concepts.base import NotFittedError
from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.devices import input_device
from conceptlens.distributed import DistributedRun
from conceptlens.distributed_checks import fingerprint as rank_fingerprint
from conceptlens.filters import FilterConfig, RowFilter  # noqa: F401 (FilterConfig and fit_config: imported from here)
from conceptlens.fit_config import FitConfig, fit_config  # noqa: F401
from conceptlens.fit_keys import Key, Plan, folder, key_name, key_sites, plan_extractors, where
from conceptlens.interface import AttachedModel

log = logging.getLogger(__name__)

class TokenRows(NamedTuple):
    """Where the rows given to an extractor come from; passed as `update(x, tokens=...)` to
    extractors whose update takes a `tokens` keyword (the description pass)."""

    doc: Tensor
    """`(N,)` index of each row's document in the data source."""
    pos: Tensor
    """`(N,)` position of each row in its document."""
    ids: Tensor
    """`(B, T)` token ids of the whole batch, -1 on padding (right-padded: column = position)."""
    first_doc: int
    """Document index of batch row 0."""


@dataclass
class FitReport:
    """What a fit saw and produced."""

    tokens: int
    """Real (non-padding) tokens forwarded (distributed: of every rank)."""
    documents: int
    """Documents read (distributed: by this rank; `conceptlens fit` reports the sum over ranks)."""
    batches: int
    seconds: float
    """Wall time of this call (not counting time before a resume)."""
    resumed_from: int
    """Tokens already seen in the checkpoint this call resumed from (0: fresh start)."""
    rows: dict[str, dict[str, int]]
    """Per site: rows seen, kept, and dropped per reason (non-finite, first position, norm outlier)."""
    stats: dict[str, Any]
    """Per extractor key: its own statistics (FVU, L0, usage, ...) when it reports any."""
    fed: dict[str, int] = field(default_factory=dict)
    """Per extractor key: the tokens forwarded while it was fed (`tokens`, or where its own budget,
    `FitConfig.extractor_tokens`, stopped it); a concept set also records it in `config["fit"]`."""
    concepts: dict[str, ConceptSet] = field(repr=False, default_factory=dict)

    @property
    def extractors(self) -> dict[str, Any]:
        """The same as `stats` (the earlier name, kept for earlier code)."""
        return self.stats

    def summary(self) -> str:
        new = self.tokens - self.resumed_from  # the rate of this call: time before a resume is not counted
        rate = new / self.seconds if self.seconds else 0.0
        resumed = f" ({new:,} after resuming at {self.resumed_from:,})" if self.resumed_from else ""
        lines = [f"{self.tokens:,} tokens{resumed} in {self.documents:,} documents, {self.seconds:.1f} s "
                 f"({rate:,.0f} tok/s)"]
        for name, fed in self.fed.items():
            if fed < self.tokens:
                lines.append(f"  {name}: fed the first {fed:,} tokens, its own budget")
        for site, c in self.rows.items():
            lines.append(f"  {site}: kept {c['kept']:,} of {c['seen']:,} rows (first position {c['first_position']:,}, "
                         f"norm outliers {c['norm_outlier']:,}, non-finite {c['nonfinite']:,})")
        return "\n".join(lines)


def fit(lens: AttachedModel, extractors: Mapping[Any, Any], data: Any, *, tokenizer: Any = None,
        config: FitConfig | None = None) -> FitReport:
    """Stream `data` through the model once, feeding every extractor; see the module docstring.
    The keys are `Key`s (a mapping's key type is invariant, so any narrower one is accepted;
    `plan_extractors` checks them).
    The checkpoint_dir is locked while the fit writes it (`conceptlens.runlock`; only rank 0
    of a distributed fit writes it)."""
    config = config or FitConfig()
    writes = config.checkpoint_dir if not config.distributed or _rank() == 0 else None  # the folder this rank writes
    with runlock.lock(writes, "fit") if writes is not None else nullcontext():
        return _fit(lens, extractors, data, tokenizer=tokenizer, config=config)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _rows_dtype(model: Any, dtype: torch.dtype | str) -> torch.dtype | str:
    """The dtype of the rows a fit's extractors get: `dtype`, or for "model" the model's own (its
    first floating parameter's)."""
    if dtype != "model":
        return dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _fit(lens: AttachedModel, extractors: Mapping[Key, Any], data: Any, *, tokenizer: Any, config: FitConfig) -> FitReport:
    from conceptlens import data as datasets

    tokenizer = tokenizer or lens.tokenizer
    if tokenizer is None:
        raise ValueError("fit needs a tokenizer: conceptlens.attach(model, tokenizer) or fit(..., tokenizer=...)")
    plan = plan_extractors(lens, extractors)
    unknown = sorted(set(config.extractor_tokens) - set(plan.extractors))
    if unknown:
        raise ValueError(f"extractor_tokens names {unknown[0]!r}, which is not an extractor of this fit; "
                         f"its extractors: {', '.join(sorted(plan.extractors))}")
    batching = {"batch_size": config.batch_size, "max_length": config.max_length, "filters": asdict(config.filters)}
    rows = _rows_dtype(lens.model, config.dtype)
    if rows != torch.float32:  # (only then, so a checkpoint of float32 rows from before this key still resumes)
        batching["dtype"] = str(rows)  # the extractors' rows: a resume in another dtype would mix two fits
    # named extractors: which sites each reads is part of what must not change (in key_name's form
    # without the extractor, "a->b" for any two sites, so checkpoints from before "a+b" resume)
    moved = {name: key_name(key) for name, key in plan.keys.items() if name != key_name(key, plan.extractors[name])}
    if moved:
        batching["sites"] = moved
    check_max_length(lens.model, config.max_length, tokenizer=tokenizer)
    state = FitState(RowFilter(config.filters), plan.extractors, fit_fingerprint(lens.model, plan.extractors, batching))
    named = {name: key_name(plan.keys[name], plan.extractors[name]) for name in moved}
    if named != moved:  # a checkpoint of a named crosscoder written while its sites were recorded as "a+b"
        state.also_resumes.append(fit_fingerprint(lens.model, plan.extractors, batching | {"sites": named}))
    run = state.run = DistributedRun.start() if config.distributed else None
    if run is not None:
        # an extractor not sharded is updated on one rank, shared at the end; its sites go to that rank
        run.place(plan.extractors, {name: key_sites(key) for name, key in plan.keys.items()})
    checkpoint = Path(config.checkpoint_dir) / CHECKPOINT if config.checkpoint_dir else None
    texts = datasets.iter_texts(data)
    if run is not None:  # the ranks agree on model, data, extractors and options before any step
        options = {k: v for k, v in asdict(config).items() if k != "progress"} | {"sites": moved}
        texts = run.shard(texts, config.batch_size, lambda first: rank_fingerprint(
            state.fingerprint["model"], first, plan.extractors, options))
    if checkpoint is not None:
        widths = {name: math.prod(int(s) for s in lens.site(k).shape[2:]) for name, k in plan.keys.items()
                  if isinstance(k, str)}
        texts = state.open(checkpoint, texts, resume=config.resume, widths=widths, max_tokens=config.max_tokens)
        if run is not None:  # e.g. ranks without a shared run folder: one resumed, another started afresh
            run.agree_on_progress(state.tokens, state.batches)
    resumed_from, start = state.tokens, time.perf_counter()
    if resumed_from:
        log.info("resuming %s at %d tokens (%d documents)", checkpoint, state.tokens, state.documents)
    _check_resumed_budgets(config.extractor_tokens, state, checkpoint)
    bar = _progress(config, plan, resumed_from, run is None or run.writes)
    next_checkpoint = _next_mark(state.tokens, config.checkpoint_every)
    batches = _batches(texts, config.batch_size)
    deferred = interrupts.deferred() if checkpoint is not None and run is None else nullcontext(None)
    live = _live_sites(plan, state)
    with ExitStack() as hold, deferred as ctrl_c:
        cap = _capture(lens, hold, live, config)
        for docs in batches if run is None else run.lockstep(batches):
            if config.max_tokens is not None and state.tokens >= config.max_tokens:
                break  # (distributed: tokens are the global count, so every rank stops here)
            if not live:
                break  # every extractor has had its own budget
            n_tokens = _step(cap, tokenizer, docs, config.max_length, plan, state, lens.model)
            state.advance(docs, n_tokens)  # (distributed: the global step's tokens)
            _spend_budgets(config.extractor_tokens, state)
            if (now := _live_sites(plan, state)) != live:  # a site only spent extractors read is captured
                cap.close()  # no more: forwards stop at the deepest site still read (every rank alike)
                cap, live = _capture(lens, hold, now, config), now
            bar.update(n_tokens)
            if checkpoint is not None and next_checkpoint is not None and state.tokens >= next_checkpoint:
                state.save(checkpoint)
                next_checkpoint = _next_mark(state.tokens, config.checkpoint_every)
            if ctrl_c is not None and ctrl_c.pressed:
                break
    bar.close()
    if checkpoint is not None:  # before flushing, so a longer resumed fit equals one long fit
        state.save(checkpoint)
    if ctrl_c is not None and ctrl_c.pressed:  # Ctrl-C: the batches done are saved, then it stops
        raise KeyboardInterrupt(f"stopped after {state.tokens:,} tokens, saved in {checkpoint}; run it again "
                                f"to resume from {state.tokens:,} tokens")
    for name, extractor in plan.extractors.items():  # train on rows still held in mixing buffers
        flush = getattr(extractor, "flush", None)
        if callable(flush) and (run is None or run.updates(name)):
            try:
                flush()
            except NotFittedError:  # too few rows to start: the report says so, the other sets are kept
                pass
    if run is not None:
        run.share(plan.extractors, state.row_filter)
    return _report(lens, plan, state, resumed_from, time.perf_counter() - start, config)


def _live_sites(plan: Plan, state: FitState) -> set[str]:
    """The sites some extractor without a spent budget still reads."""
    return {site for name, key in plan.keys.items() if name not in state.stopped for site in key_sites(key)}


def _capture(lens: AttachedModel, hold: ExitStack, sites: set[str], config: FitConfig) -> Any:
    """The fit's capture of `sites` (those `_live_sites` gives: a spent site is neither copied nor
    filtered, so `FitReport.rows` counts its rows up to its budget), held open by `hold`; None for none."""
    return hold.enter_context(lens.capture(sorted(sites), dtype=config.dtype)) if sites else None


def _spend_budgets(budgets: Mapping[str, int], state: FitState) -> None:
    """After a batch: mark the extractors whose own budget (`FitConfig.extractor_tokens`) the tokens so
    far reach (`state.stopped`: the tokens each was fed; `_step` feeds them no more). The rule is
    `max_tokens`'s, so an extractor's rows are those of a fit with `max_tokens` at its budget; marked
    before any checkpoint of that batch, so a resume knows which budgets were spent."""
    for name, budget in budgets.items():
        if name not in state.stopped and state.tokens >= budget:
            state.stopped[name] = state.tokens


def _check_resumed_budgets(budgets: Mapping[str, int], state: FitState, checkpoint: Path | None) -> None:
    """On resume, say where the budgets now given cannot be what the checkpointed fit did: a spent
    budget raised (the pass has moved on: the extractor stays where it stopped), or a budget added or
    lowered below the tokens already fed (it stops now, past it)."""
    for name, fed in state.stopped.items():
        budget = budgets.get(name)
        if budget is None or budget > fed:
            warnings.warn(f"{name} stopped at its budget after {fed:,} tokens in {checkpoint}; the pass has moved "
                          f"on since, so it stays at {fed:,} (to fit it on more, start the run again)", stacklevel=4)
    for name, budget in budgets.items():
        if name not in state.stopped and state.tokens >= budget:
            warnings.warn(f"{name}'s budget of {budget:,} tokens is below the {state.tokens:,} it was fed before "
                          f"{checkpoint} was resumed; it stops now, at {state.tokens:,} (to fit it on {budget:,}, "
                          "start the run again)", stacklevel=4)
    _spend_budgets(budgets, state)  # those stop now


def _batches(texts: Iterator[str], size: int) -> Iterator[list[str]]:
    while batch := list(islice(texts, size)):
        yield batch


def _step(cap, tokenizer, docs: list[str], max_length: int, plan: Plan, state: FitState, model) -> int:
    """One batch through the model and into every extractor; returns its real tokens.
    Distributed: every rank's rows of the step, gathered in document order, go through the
    same single-process step on every rank (see conceptlens/distributed.py)."""
    run = state.run
    batch = encode_batch(tokenizer, docs or ["."], max_length)
    n_tokens = int(batch["attention_mask"].sum()) if docs else 0
    if n_tokens == 0 and run is None:
        return 0  # empty documents only: nothing to forward
    ids = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -1)[: len(docs)]  # (B, T)
    if n_tokens == 0:  # distributed, nothing real on this rank: a stub gives the sites' shapes, no rows
        batch = encode_batch(tokenizer, ["."], max_length)
    if run is not None:  # every rank pads to the global batch's width, as one process pads its batch
        batch = run.pad_to_global_width(batch, real=n_tokens > 0)
    device = input_device(model)  # with a device map: the input embeddings' device
    acts, meta = cap.forward(**{k: v.to(device) for k, v in batch.items()})  # no_grad inside
    first_doc = state.documents
    if run is not None:
        step = run.gather_step(acts, meta, ids, n_tokens, state.documents, with_ids=bool(plan.token_aware))
        acts, meta, n_tokens, first_doc, ids = step.acts, step, step.tokens, step.first_doc, step.ids
        if n_tokens == 0:
            return 0
    keep = {site: state.row_filter(site, acts[site], meta.position) for site in plan.sites if site in acts}
    for name, extractor in plan.extractors.items():
        if (run is not None and not run.updates(name)) or name in state.stopped:
            continue  # another rank updates it (see DistributedRun.place), or its own budget is spent
        key = plan.keys[name]
        if isinstance(key, str):
            rows = keep[key]
            if not rows.any():
                continue
            extra = {}
            if name in plan.token_aware:
                where = rows.to(meta.row.device)
                extra["tokens"] = TokenRows(meta.row[where] + first_doc, meta.position[where], ids.to(rows.device),
                                            first_doc)
            extractor.update(_as_rows(acts[key][rows]), **extra)
        else:
            sites = key_sites(key)
            rows = keep[sites[0]]
            for site in sites[1:]:
                rows = rows & keep[site].to(rows.device)  # sites may sit on several devices
            if not rows.any():
                continue
            # pair extractors get q/k/v per head, (N, H, d_head); sequence ids = document index
            extra = {"sequence_ids": meta.row[rows.to(meta.row.device)] + first_doc} \
                if name in plan.sequence_aware else {}
            take = lambda s: acts[s][rows.to(acts[s].device)]  # noqa: E731
            extractor.update(*(take(g) if isinstance(g, str) else tuple(map(take, g)) for g in key), **extra)
    return n_tokens


def _as_rows(x: Tensor) -> Tensor:
    # Single-site extractors get (N, d) rows: q/k/v heads are concatenated.
    return x if x.ndim == 2 else x.reshape(x.shape[0], -1)


def _next_mark(tokens: int, every: int | None) -> int | None:
    return None if every is None else (tokens // every + 1) * every


def _progress(config: FitConfig, plan: Plan, initial: int, show: bool = True):
    """The token bar; its total is where the fit will stop: `max_tokens`, or the largest of the
    budgets when every extractor has its own (None, no total, when the data decides)."""
    from tqdm.auto import tqdm

    totals = [config.max_tokens] if config.max_tokens is not None else []
    if set(plan.extractors) <= set(config.extractor_tokens):
        totals.append(max(config.extractor_tokens[name] for name in plan.extractors))
    return tqdm(total=min(totals, default=None), initial=initial, unit="tok", unit_scale=True,
                disable=not (config.progress and show), desc="fit", dynamic_ncols=True)


def _report(lens: AttachedModel, plan: Plan, state: FitState, resumed_from: int, seconds: float,
            config: FitConfig) -> FitReport:
    concepts: dict[str, ConceptSet] = {}
    stats: dict[str, Any] = {}
    fed = {name: state.stopped.get(name, state.tokens) for name in plan.extractors}
    for name, extractor in plan.extractors.items():
        key = plan.keys[name]
        extractor_stats = getattr(extractor, "stats", None)
        stats[name] = extractor_stats() if callable(extractor_stats) else extractor_stats
        if not callable(getattr(extractor, "concept_set", None)):
            continue  # a statistic (e.g. q/k moments), not a concept extractor
        try:
            cs = extractor.concept_set()
        except NotFittedError as err:  # e.g. too few rows to initialise: say so, keep the others
            warnings.warn(f"no concepts from {name}: {err}", stacklevel=3)
            stats[name] = {"error": str(err), "stats": stats[name]}
            continue
        cs.site, fit_info = where(extractor, key)
        if cs.config.get("space") == "clvq_z_e":  # codes in an encoder space: a label, not a site
            cs.site = f"{key[0]}->{key[1]}:z_e"
        cs.model = cs.model or lens.name
        cs.config.setdefault("fit", {"tokens": fed[name], **fit_info})
        concepts[name] = cs
        if config.checkpoint_dir and (state.run is None or state.run.writes):
            cs.save(Path(config.checkpoint_dir) / "concepts" / folder(name))
    return FitReport(state.tokens, state.documents, state.batches, seconds, resumed_from,
                     {k: dict(v) for k, v in state.row_filter.counts.items()}, stats, fed, concepts)

