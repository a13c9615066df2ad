"""Faithfulness: does a task need what the concepts span? Ablate them, against random controls.

    result = faithfulness(lens, cs[[3, 7]], texts)                         # next-token loss
    result = faithfulness(lens, cs[[3, 7]], texts, task=ProbeTask(labels, site="blocks.20.resid_out"))
    print(result.summary())     # clean, ablated, random controls: harm and z against the controls

The concept directions are projected out at their site (`lens.ablate`) while the task is
evaluated; the same is done with `n_controls` random orthonormal sets of the same rank at
the same site. Concepts the task relies on hurt it more than random directions do.

Tasks: `"next_token"` — the model's mean cross-entropy over real next tokens; or a
`ProbeTask` — a multinomial logistic probe trained on clean activations (pooled per text)
at `task.site`, scored on held-out texts by log-loss or accuracy.

The math (random bases, the probe, the cross-entropy) is pure functions on tensors; the
lens is only driven through `lens.ablate` and `lens.capture`.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from conceptlens.batching import pad_right

if TYPE_CHECKING:
    from conceptlens.concepts.conceptset import ConceptSet
    from conceptlens.lens import Lens

Texts = Sequence[str] | Sequence[Sequence[int]]


# -- pure math ------------------------------------------------------------------------------
def random_orthonormal(n: int, d: int, generator: torch.Generator) -> Tensor:
    """(n, d) rows of an orthonormal basis of a uniformly random n-dim subspace (Gaussian + QR)."""
    q, r = torch.linalg.qr(torch.randn(d, n, generator=generator, dtype=torch.float64))
    return (q * r.diagonal().sign()).T.float()  # sign fix: Haar-distributed, not QR-biased


def direction_rank(directions: Tensor) -> int:
    """Dimension of the span that ProjectOut removes: (n, d) -> rank."""
    return int(torch.linalg.matrix_rank(directions.double(), rtol=1e-10))


class LinearProbe(NamedTuple):
    """Multinomial logistic regression on standardised features."""

    mean: Tensor   # (d,)
    scale: Tensor  # (d,)
    weight: Tensor  # (K, d)
    bias: Tensor   # (K,)

    def logits(self, x: Tensor) -> Tensor:
        """(N, d) -> (N, K)"""
        return ((x.double() - self.mean) / self.scale) @ self.weight.T + self.bias


def fit_probe(x: Tensor, y: Tensor, C: float = 1.0, max_iter: int = 500) -> LinearProbe:
    """Fit a multinomial logistic probe: `(N, d)`, labels `(N,)` in 0..K-1 -> LinearProbe.

    Minimises sklearn's `LogisticRegression(C=C)` objective on standardised features,
    C * sum of log-losses + |W|^2 / 2 (intercepts free), with L-BFGS in float64.
    """
    if not (C > 0 and math.isfinite(C)):
        raise ValueError(f"C must be a positive finite number; got {C}")
    x, y = x.double(), y.long()
    mean, scale = x.mean(0), x.std(0, correction=0)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant features stay 0
    z = (x - mean) / scale
    weight = torch.zeros(int(y.max()) + 1, x.shape[1], dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(weight.shape[0], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([weight, bias], max_iter=max_iter, tolerance_grad=1e-10, tolerance_change=1e-14,
                            history_size=20, line_search_fn="strong_wolfe")

    def objective() -> Tensor:
        opt.zero_grad()
        loss = C * F.cross_entropy(z @ weight.T + bias, y, reduction="sum") + 0.5 * weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(objective)
    return LinearProbe(mean, scale, weight.detach(), bias.detach())


def probe_scores(probe: LinearProbe, x: Tensor, y: Tensor) -> dict[str, float]:
    """Mean log-loss (nats) and accuracy of `probe` on `(N, d)` features with labels `(N,)`."""
    logits = probe.logits(x)
    return {"log_loss": float(F.cross_entropy(logits, y.long())),
            "accuracy": float((logits.argmax(-1) == y).double().mean())}


def next_token_loss_sum(logits: Tensor, ids: Tensor, mask: Tensor) -> tuple[float, int]:
    """Summed cross-entropy of each real token given its real predecessors, and their count.

    logits `(B, T, V)`, ids and mask `(B, T)`; position t predicts token t + 1.
    """
    valid = (mask[:, 1:] & mask[:, :-1]).bool()  # (B, T-1)
    ce = F.cross_entropy(logits[:, :-1][valid].double(), ids[:, 1:][valid], reduction="sum")
    return float(ce), int(valid.sum())


def pool(acts: Tensor, row: Tensor, position: Tensor, n_rows: int, how: Literal["mean", "last"]) -> Tensor:
    """Per-text features from flat token activations `(N, d)` -> `(n_rows, d)`.

    "mean" averages each text's tokens after its first (the first is an attention sink whose
    norm can be 100x the others); a one-token text keeps its only token. "last": last token.
    """
    if how == "last":
        last = torch.zeros(n_rows, dtype=torch.long).scatter_reduce(0, row, position, "amax")
        return acts[position == last[row]]  # flat rows are in (row, position) order: one per text
    use = (position > 0) | (torch.bincount(row, minlength=n_rows)[row] == 1)
    order = torch.argsort(row[use], stable=True)
    counts = torch.bincount(row[use], minlength=n_rows)  # (n_rows,)
    # segment sums as differences of a running sum (index_add_ can be 1000x slower on a busy CPU)
    running = F.pad(acts[use][order].double().cumsum(0), (0, 0, 1, 0))  # (N_used + 1, d)
    ends = counts.cumsum(0)
    return ((running[ends] - running[ends - counts]) / counts.clamp(min=1)[:, None]).float()


# -- tasks and results -----------------------------------------------------------------------
@dataclass
class ProbeTask:
    """A linear probe on clean activations, scored under ablation on held-out texts."""

    labels: Sequence[int] | Sequence[str] | Tensor
    """One label per text: class indices 0..K-1, or names (numbered in sorted order)."""
    site: str | None = None
    """Where the probe reads: the ablated site or any later one (default: the concepts' site)."""
    pool: Literal["mean", "last"] = "mean"
    """How a text's tokens become one feature vector (see `pool`)."""
    metric: Literal["log_loss", "accuracy"] = "log_loss"
    """What the result reports."""
    test_fraction: float = 0.5
    """Share of texts held out from the probe's training, drawn with the seed."""
    C: float = 1.0
    """Inverse L2 strength of the probe, as in sklearn."""
    y: Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        labels = self.labels
        if len(labels) and isinstance(labels[0], str):
            index = {name: i for i, name in enumerate(sorted(set(labels)))}
            labels = [index[name] for name in labels]
        self.y = torch.as_tensor(labels, dtype=torch.long).reshape(-1)
        if len(self.y) and self.y.min() < 0:
            raise ValueError(f"labels must be class indices 0..K-1; got {int(self.y.min())}")
        if len(torch.unique(self.y)) < 2:
            raise ValueError(f"labels need at least two classes; got {torch.unique(self.y).tolist()}")
        if self.pool not in ("mean", "last"):
            raise ValueError(f"pool must be 'mean' or 'last'; got {self.pool!r}")
        if self.metric not in ("log_loss", "accuracy"):
            raise ValueError(f"metric must be 'log_loss' or 'accuracy'; got {self.metric!r}")
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"test_fraction must be in (0, 1); got {self.test_fraction}")


class FaithfulnessResult(NamedTuple):
    """Task metric clean, with the concepts ablated, and with random controls ablated."""

    metric: str
    """What was measured: "next_token_loss" (nats), "log_loss" (nats) or "accuracy"."""
    clean: float
    ablated: float
    controls: Tensor
    """(n_controls,) the metric with each random set ablated."""
    n_directions: int
    """Rank of the ablated span (and of each control)."""

    @property
    def control_mean(self) -> float:
        return float(self.controls.mean())

    @property
    def control_std(self) -> float:
        return float(self.controls.std())

    @property
    def harm(self) -> float:
        """How much worse the ablation makes the task (positive = worse)."""
        return self._worse(self.ablated)

    @property
    def control_harm(self) -> float:
        """Mean harm of the random controls."""
        return self._worse(self.control_mean)

    @property
    def z(self) -> float:
        """(harm - control harm) in control standard deviations."""
        return (self.harm - self.control_harm) / self.control_std if self.control_std > 0 else math.nan

    def _worse(self, value: float) -> float:
        return self.clean - value if self.metric == "accuracy" else value - self.clean

    def summary(self) -> str:
        return (f"{self.metric}: clean {self.clean:.4f}, ablated ({self.n_directions} directions) "
                f"{self.ablated:.4f}, random controls {self.control_mean:.4f} +- {self.control_std:.4f} "
                f"(n={len(self.controls)}); harm {self.harm:+.4f} vs {self.control_harm:+.4f}, z = {self.z:.1f}")


# -- driving the model -------------------------------------------------------------------------
def faithfulness(lens: Lens, concepts: ConceptSet | Tensor, texts: Texts, *,
                 task: Literal["next_token"] | ProbeTask = "next_token", site: str | None = None,
                 n_controls: int = 5, seed: int = 0, batch_size: int = 8, max_length: int = 128,
                 tokenizer: Any = None) -> FaithfulnessResult:
    """Ablate `concepts` at their site (or `site=`) and compare the task's harm with random controls.

    texts: strings (tokenised with `tokenizer` or the lens's) or lists of token ids.
    Random controls are `n_controls` Gaussian sets of the same rank, orthonormalised, drawn
    from `seed`; the probe's train/test split is drawn from the same seed.
    """
    directions = concepts.directions if hasattr(concepts, "directions") else torch.as_tensor(concepts)
    directions = directions.reshape(-1, directions.shape[-1]).float()
    site = site or getattr(concepts, "site", None)
    if not site:
        raise ValueError(f"{type(concepts).__name__} carries no site; pass site='blocks.{{i}}.resid_out'")
    site = lens.site(site).name
    if n_controls < 2:
        raise ValueError(f"n_controls must be at least 2 (their spread is part of the result); got {n_controls}")
    ids = _token_ids(texts, tokenizer or lens.tokenizer, max_length)
    generator = torch.Generator().manual_seed(seed)
    if task == "next_token":
        if getattr(lens.model.config, "is_encoder_decoder", False):
            raise ValueError("task='next_token' needs a decoder-only causal LM; use a ProbeTask here")
        batches = _batches(ids, batch_size)
        evaluate, metric = (lambda ablate: _next_token(lens, batches, ablate)), "next_token_loss"
    elif isinstance(task, ProbeTask):
        evaluate, metric = _probe_evaluator(lens, ids, batch_size, task, site, generator), task.metric
    else:
        raise ValueError(f"task must be 'next_token' or a ProbeTask; got {task!r}")
    rank = direction_rank(directions)
    clean = evaluate(None)
    ablated = evaluate((directions, site))
    controls = [evaluate((random_orthonormal(rank, directions.shape[1], generator), site))
                for _ in range(n_controls)]
    return FaithfulnessResult(metric, clean, ablated, torch.tensor(controls, dtype=torch.float64), rank)


Ablation = tuple[Tensor, str] | None


def _token_ids(texts: Texts, tokenizer: Any, max_length: int) -> list[list[int]]:
    if isinstance(texts, str) or not texts:
        raise ValueError(f"texts must be a non-empty list of strings or token-id lists; got {texts!r}")
    if isinstance(texts[0], str):
        if tokenizer is None:
            raise ValueError("string texts need a tokenizer: conceptlens.attach(model, tokenizer) or tokenizer=")
        ids = tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]
    else:
        ids = [list(map(int, t))[:max_length] for t in texts]
    empty = [i for i, t in enumerate(ids) if not t]
    if empty:
        raise ValueError(f"texts {empty[:5]} have no tokens")
    return ids


def _batches(ids: list[list[int]], batch_size: int) -> list[dict[str, Tensor]]:
    """Right-padded `input_ids` / `attention_mask` batches (pad id 0, masked out)."""
    return [pad_right(ids[start:start + batch_size]) for start in range(0, len(ids), batch_size)]


def _ablating(lens: Lens, ablate: Ablation):
    return nullcontext() if ablate is None else lens.ablate(ablate[0], site=ablate[1])


@torch.no_grad()
def _next_token(lens: Lens, batches: list[dict[str, Tensor]], ablate: Ablation) -> float:
    device = next(lens.model.parameters()).device
    total, count = 0.0, 0
    with _ablating(lens, ablate):
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            logits = lens.model(**batch).logits
            s, n = next_token_loss_sum(logits, batch["input_ids"], batch["attention_mask"])
            total, count = total + s, count + n
    if count == 0:
        raise ValueError("the texts hold no next-token pairs (every text has one token)")
    return total / count


def _probe_evaluator(lens: Lens, ids: list[list[int]], batch_size: int, task: ProbeTask, site: str,
                     generator: torch.Generator):
    """Fit the probe on clean features of the train texts; return evaluate(ablate) on the test texts."""
    probe_site = lens.site(task.site or site).name
    if _depth(probe_site) < _depth(site):
        raise ValueError(f"the probe reads {probe_site!r}, before the ablated site {site!r}: "
                         "the ablation cannot reach it; probe at the ablated site or a later one")
    if len(task.y) != len(ids):
        raise ValueError(f"ProbeTask has {len(task.y)} labels for {len(ids)} texts")
    perm = torch.randperm(len(ids), generator=generator)
    n_test = max(1, min(len(ids) - 2, round(task.test_fraction * len(ids))))
    test, train = perm[:n_test], perm[n_test:]
    clean = _features(lens, _batches(ids, batch_size), probe_site, task.pool, None)
    probe = fit_probe(clean[train], task.y[train], C=task.C)
    test_batches = _batches([ids[i] for i in test.tolist()], batch_size)

    def evaluate(ablate: Ablation) -> float:
        x = clean[test] if ablate is None else _features(lens, test_batches, probe_site, task.pool, ablate)
        return probe_scores(probe, x, task.y[test])[task.metric]

    return evaluate


def _depth(site: str) -> tuple[int, float]:
    """(stack, block) order of a canonical site name: embed before block 0, final after the last."""
    stack, _, rest = site.partition(".") if site.startswith(("encoder.", "decoder.")) else ("", "", site)
    block = -1.0 if rest == "embed" else math.inf if rest == "final" else float(rest.split(".")[1])
    return int(stack == "decoder"), block


@torch.no_grad()
def _features(lens: Lens, batches: list[dict[str, Tensor]], site: str, how: Literal["mean", "last"],
              ablate: Ablation) -> Tensor:
    """(n_texts, d) pooled activations at `site`; the capture opens inside the ablation so it
    reads the edited activations even at the ablated site itself."""
    device = next(lens.model.parameters()).device
    pooled = []
    with _ablating(lens, ablate), lens.capture(site) as capture:
        for batch in batches:
            acts = capture.forward(**{k: v.to(device) for k, v in batch.items()})[site].cpu()
            meta = capture.last[1]
            pooled.append(pool(acts.flatten(1), meta.row.cpu(), meta.position.cpu(), len(batch["input_ids"]), how))
    return torch.cat(pooled)
