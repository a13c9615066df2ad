"""Faithfulness: does a task need what the concepts span? Ablate them, against matched controls.

    result = faithfulness(lens, cs[[3, 7]].centred(), texts)             # next-token loss
    result = faithfulness(lens, cs[[3, 7]], texts, task=ProbeTask(labels, site="blocks.20.resid_out"),
                          controls="concepts", control_set=cs)
    print(result.summary())     # clean (with its baseline), ablated, controls +- spread, z, warnings

The concepts' span is ablated at their site (`steering.ablate.Ablate`, `mode` "projection" or
"mean") at `positions` — by default every position but the first, the attention sink the fits
leave out — while the task is evaluated; the same is done with `n_controls` control sets of
the same rank. Controls (`metrics.controls`): "covariance" (default) — Gaussian directions
with the activations' covariance at the site, measured on the texts; "random" — isotropic
random subspaces, which in a residual stream mostly miss the variance and make any concept
look important; "concepts" — random other concepts of `control_set`, centred when the
concepts are. The result also holds the task's baseline (unigram entropy, base-rate entropy,
chance) and the metric with the whole site zeroed, and says when the comparison means little.

Tasks: `"next_token"` — the model's mean cross-entropy over real next tokens; or a
`ProbeTask` — a multinomial logistic probe trained on clean activations (pooled per text)
at `task.site`, scored on held-out texts by log-loss or accuracy.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from conceptlens.batching import pad_right, tokenize
from conceptlens.devices import input_device
from conceptlens.interface import AttachedModel
from conceptlens.metrics.controls import (SiteMoments, base_rate_entropy, concept_subsets, covariance_directions,
                                          majority_accuracy, random_orthonormal, unigram_entropy)
from conceptlens.metrics.faithfulness_result import CONTROLS, FaithfulnessResult
from conceptlens.metrics.probe import LinearProbe, ProbeTask, fit_probe, pool, probe_scores

if TYPE_CHECKING:
    from conceptlens.concepts.conceptset import ConceptSet
    from conceptlens.steering.edits import Edit
    from conceptlens.steering.scope import Positions

Texts = Sequence[str] | Sequence[Sequence[int]]
__all__ = ["FaithfulnessResult", "LinearProbe", "ProbeTask", "direction_rank", "faithfulness", "fit_probe",
           "next_token_loss_sum", "pool", "probe_scores", "random_orthonormal"]


# -- pure math ------------------------------------------------------------------------------
def direction_rank(directions: Tensor) -> int:
    """Dimension of the span that ProjectOut removes: (n, d) -> rank."""
    return int(torch.linalg.matrix_rank(directions.double(), rtol=1e-10))


def next_token_loss_sum(logits: Tensor, ids: Tensor, mask: Tensor) -> tuple[float, int]:
    """Summed cross-entropy of each real token given its real predecessors, and their count.

    logits `(B, T, V)`, ids and mask `(B, T)`; position t predicts token t + 1.
    """
    valid = (mask[:, 1:] & mask[:, :-1]).bool()  # (B, T-1)
    ce = F.cross_entropy(logits[:, :-1][valid].double(), ids[:, 1:][valid], reduction="sum")
    return float(ce), int(valid.sum())


# -- driving the model -------------------------------------------------------------------------
def faithfulness(lens: AttachedModel, concepts: ConceptSet | Tensor, texts: Texts, *,
                 task: Literal["next_token"] | ProbeTask = "next_token", site: str | None = None,
                 mode: Literal["projection", "mean"] = "projection", positions: Positions = slice(1, None),
                 controls: Literal["covariance", "random", "concepts"] = "covariance",
                 control_set: ConceptSet | None = None, n_controls: int = 8, seed: int = 0, batch_size: int = 8,
                 max_length: int = 128, tokenizer: Any = None, progress: bool = False) -> FaithfulnessResult:
    """Ablate `concepts` at their site (or `site=`) and compare the task's harm with controls.

    texts: strings (tokenised with `tokenizer` or the lens's) or lists of token ids.
    positions: what the ablation edits (`lens.steer` positions; default all but position 0).
    Controls are drawn from `seed`, as is the probe's train/test split. See the module docstring.
    """
    from conceptlens.steering.ablate import Ablate

    directions = concepts.directions if hasattr(concepts, "directions") else torch.as_tensor(concepts)
    directions = directions.reshape(-1, directions.shape[-1]).float()
    site = site or getattr(concepts, "site", None)
    if not site:
        raise ValueError(f"{type(concepts).__name__} carries no site; pass site='blocks.{{i}}.resid_out'")
    resolved = lens.site(site)
    site, width = resolved.name, math.prod(int(s) for s in resolved.shape[2:])
    if directions.shape[-1] != width:
        raise ValueError(f"the concepts have width {directions.shape[-1]}, but {site} has width {width}: they were "
                         "fitted at another site or on another model")
    if n_controls < 2:
        raise ValueError(f"n_controls must be at least 2 (their spread is part of the result); got {n_controls}")
    if mode not in ("projection", "mean"):
        raise ValueError(f"mode must be 'projection' or 'mean' (zero-ablation ignores the directions: it is "
                         f"reported as result.zero_ablated); got {mode!r}")
    if controls not in CONTROLS:
        raise ValueError(f"controls must be one of {tuple(CONTROLS)}; got {controls!r}")
    ids = _token_ids(texts, tokenizer or lens.tokenizer, max_length)
    batches = _batches(ids, batch_size)
    generator = torch.Generator().manual_seed(seed)
    if task == "next_token":
        if getattr(lens.model.config, "is_encoder_decoder", False):
            raise ValueError("task='next_token' needs a decoder-only causal LM; use a ProbeTask here")
        evaluate = lambda edit: _next_token(lens, batches, edit, positions)  # noqa: E731
        metric, baseline = "next_token_loss", unigram_entropy(_targets(batches))
    elif isinstance(task, ProbeTask):
        evaluate, baseline = _probe_evaluator(lens, ids, batch_size, task, site, generator, positions)
        metric = task.metric
    else:
        raise ValueError(f"task must be 'next_token' or a ProbeTask; got {task!r}")
    mean = None if isinstance(concepts, Tensor) else concepts.mean  # a ConceptSet's fit mean, if any
    moments = _site_moments(lens, batches, site) if controls == "covariance" or (mode == "mean" and mean is None) \
        else None
    mean = mean if mean is not None else (moments.mean if moments is not None else None)
    control_sets = _control_directions(controls, directions, concepts, control_set, n_controls, moments, generator)
    # the set itself, not its directions: its model name comes along, so another model's set is warned about
    edits = [Ablate(d, mode, mean=mean, site=site) for d in [concepts, *control_sets]]
    edits.append(Ablate(directions, "zero", site=site))
    values = [evaluate(edit) for edit in _bar([None, *edits], progress, "faithfulness")]
    rank = edits[0].basis.shape[0]
    return FaithfulnessResult(metric, values[0], values[1], torch.tensor(values[2:-1], dtype=torch.float64), rank,
                              baseline, values[-1], controls, mode)


def _bar(items: list, progress: bool, desc: str) -> Any:
    if not progress:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit="eval", dynamic_ncols=True)


def _control_directions(kind: str, directions: Tensor, concepts: Any, control_set: Any, n: int,
                        moments: SiteMoments | None, generator: torch.Generator) -> list[Tensor]:
    """`n` control direction sets `(r, d)` (or `(k, d)` concepts) matched to `directions` `(k, d)`."""
    rank, d = direction_rank(directions), directions.shape[1]
    if kind == "random":
        return [random_orthonormal(rank, d, generator) for _ in range(n)]
    if kind == "covariance":
        if moments is None:
            raise ValueError("covariance controls need the site's moments; got moments=None")
        return [covariance_directions(rank, moments.cov, generator) for _ in range(n)]
    if control_set is None:
        raise ValueError("controls='concepts' needs control_set=, the full ConceptSet the concepts were chosen from")
    if control_set.d != d:
        raise ValueError(f"control_set has width {control_set.d}; the concepts have {d}")
    config = getattr(concepts, "config", {}) or {}
    if config.get("centred") and not control_set.config.get("centred"):
        control_set = control_set.centred()  # controls centred like the concepts
    exclude = list(config.get("parent_indices", []))  # the chosen concepts, when indexed from the set
    subsets = concept_subsets(len(control_set), len(directions), exclude, n, generator)
    return [control_set.directions[idx] for idx in subsets]


def _token_ids(texts: Texts, tokenizer: Any, max_length: int) -> list[list[int]]:
    if isinstance(texts, str) or not texts:
        raise ValueError(f"texts must be a non-empty list of strings or token-id lists; got {texts!r}")
    if isinstance(texts[0], str):
        if tokenizer is None:
            raise ValueError("string texts need a tokenizer: conceptlens.attach(model, tokenizer) or tokenizer=")
        ids = tokenize(tokenizer, [str(text) for text in texts], max_length)["input_ids"]
    else:
        ids = [list(map(int, t))[:max_length] for t in texts]
    empty = [i for i, t in enumerate(ids) if not t]
    if empty:
        raise ValueError(f"texts {empty[:5]} have no tokens")
    return ids


def _batches(ids: list[list[int]], batch_size: int) -> list[dict[str, Tensor]]:
    """Right-padded `input_ids` / `attention_mask` batches (pad id 0, masked out)."""
    return [pad_right(ids[start:start + batch_size]) for start in range(0, len(ids), batch_size)]


def _ablating(lens: AttachedModel, edit: Edit | None, positions: Positions):
    return nullcontext() if edit is None else lens.steer(edit, positions=positions)


def _targets(batches: list[dict[str, Tensor]]) -> Tensor:
    """(N,) every real token that follows a real token: what next-token loss predicts."""
    out = []
    for batch in batches:
        mask = batch["attention_mask"].bool()
        out.append(batch["input_ids"][:, 1:][mask[:, 1:] & mask[:, :-1]])
    return torch.cat(out)


@torch.no_grad()
def _site_moments(lens: AttachedModel, batches: list[dict[str, Tensor]], site: str) -> SiteMoments:
    """Mean and covariance of the clean activations at `site`, first positions left out."""
    device = input_device(lens.model)
    moments = SiteMoments()
    with lens.capture(site) as capture:
        for batch in batches:
            acts, meta = capture.forward(**{k: v.to(device) for k, v in batch.items()})
            moments.update(acts[site].flatten(1)[meta.position > 0].cpu())
    if moments.n < 2:
        raise ValueError("the texts leave fewer than 2 tokens after the first position to measure the site with")
    return moments


@torch.no_grad()
def _next_token(lens: AttachedModel, batches: list[dict[str, Tensor]], edit: Edit | None, positions: Positions) -> float:
    device = input_device(lens.model)
    total, count = 0.0, 0
    with _ablating(lens, edit, positions):
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            logits = lens.model(**batch).logits
            s, n = next_token_loss_sum(logits, batch["input_ids"], batch["attention_mask"])
            total, count = total + s, count + n
    if count == 0:
        raise ValueError("the texts hold no next-token pairs (every text has one token)")
    return total / count


def _probe_evaluator(lens: AttachedModel, ids: list[list[int]], batch_size: int, task: ProbeTask, site: str,
                     generator: torch.Generator, positions: Positions) -> tuple[Callable, float]:
    """Fit the probe on clean features of the train texts: (evaluate(edit) on the test texts, baseline)."""
    probe_site = lens.site(task.site or site).name
    if _depth(probe_site) < _depth(site):
        raise ValueError(f"the probe reads {probe_site!r}, before the ablated site {site!r}: "
                         "the ablation cannot reach it; probe at the ablated site or a later one")
    if len(task.y) != len(ids):
        raise ValueError(f"ProbeTask has {len(task.y)} labels for {len(ids)} texts")
    perm = torch.randperm(len(ids), generator=generator)
    n_test = max(1, min(len(ids) - 2, round(task.test_fraction * len(ids))))
    test, train = perm[:n_test], perm[n_test:]
    clean = _features(lens, _batches(ids, batch_size), probe_site, task.pool, None, positions)
    probe = fit_probe(clean[train], task.y[train], C=task.C)
    test_batches = _batches([ids[i] for i in test.tolist()], batch_size)

    def evaluate(edit: Edit | None) -> float:
        x = clean[test] if edit is None else _features(lens, test_batches, probe_site, task.pool, edit, positions)
        return probe_scores(probe, x, task.y[test])[task.metric]

    y_train, y_test = task.y[train], task.y[test]
    baseline = base_rate_entropy(y_train, y_test) if task.metric == "log_loss" else majority_accuracy(y_train, y_test)
    return evaluate, baseline


def _depth(site: str) -> tuple[int, float, int]:
    """(stack, block, within) order of a canonical site name: embed before block 0, final after the last;
    within a block its resid_in before its other sites, and those before its resid_out (the order of
    attention and MLP sites inside a block depends on the architecture: they count as one)."""
    stack, _, rest = site.partition(".") if site.startswith(("encoder.", "decoder.")) else ("", "", site)
    block = -1.0 if rest == "embed" else math.inf if rest == "final" else float(rest.split(".")[1])
    within = 0 if rest.endswith(".resid_in") else 2 if rest.endswith(".resid_out") else 1
    return int(stack == "decoder"), block, within


@torch.no_grad()
def _features(lens: AttachedModel, batches: list[dict[str, Tensor]], site: str, how: Literal["mean", "last"],
              edit: Edit | None, positions: Positions) -> Tensor:
    """(n_texts, d) pooled activations at `site`; the capture opens inside the ablation so it
    reads the edited activations even at the ablated site itself."""
    device = input_device(lens.model)
    pooled = []
    with _ablating(lens, edit, positions), lens.capture(site) as capture:
        for batch in batches:
            acts, meta = capture.forward(**{k: v.to(device) for k, v in batch.items()})
            pooled.append(pool(acts[site].cpu().flatten(1), meta.row.cpu(), meta.position.cpu(),
                               len(batch["input_ids"]), how))
    return torch.cat(pooled)
