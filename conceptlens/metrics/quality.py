"""How good a set of concepts is: probing, stability across runs, geometry, reconstruction.

    probe_loss(z_train, y_train, z_test, y_test).loss   # best single concept per label, test log-loss (000)
    standardised_probe_loss(...)                         # the same on standardised columns: scale-free
    mppc(z_run1, z_run2)                                 # 1.0 = every concept of run 2 has a twin in run 1
    fvu(x, x_hat), l0(z), dead_fraction(z)               # SAE reconstruction and sparsity
    ce_loss_recovered(clean, spliced, zero)              # 1.0 = splicing the SAE costs nothing

Pure functions on tensors: z `(N, n_concepts)` are concept activations of N tokens, x `(N, d)`
activations, directions `(n, d)`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from conceptlens.metrics.gauge_sites import warn_if_qk

_CHUNK_ELEMENTS = 1 << 22  # float64 elements per chunk of concepts: bounds memory at ~32 MB


def _chunk(n_rows: int) -> int:
    """Columns per chunk for a matrix of n_rows rows."""
    return max(1, _CHUNK_ELEMENTS // max(n_rows, 1))


def _logistic_objective(x: Tensor, y: Tensor, w: Tensor, b: Tensor, C: float) -> Tensor:
    """sum_n log(1 + e^z) - y z + w^2 / 2C, z = w x + b: sklearn's objective. `(N, M) -> (M,)`."""
    z = x * w + b
    return (torch.logaddexp(torch.zeros_like(z), z) - y[:, None] * z).sum(0) + w**2 / (2 * C)


def fit_logistic_1d(x: Tensor, y: Tensor, C: float = 1.0, max_iter: int = 100) -> tuple[Tensor, Tensor]:
    """One 1-D logistic regression per column, all at once: Newton's method with backtracking.

        w, b = fit_logistic_1d(z, y)       # z: (N, M), y: (N,) in {0, 1} -> w, b: (M,) float64

    Minimises sklearn's `LogisticRegression(C=C)` objective (L2 on w, intercept free), so the
    fits equal sklearn's; C must be finite (the penalty keeps separable columns bounded).
    """
    if not (C > 0 and math.isfinite(C)):
        raise ValueError(f"C must be a positive finite number; got {C}")
    x, y = x.double(), y.double()
    rate = y.mean().clamp(1e-12, 1 - 1e-12)
    w = torch.zeros(x.shape[1], dtype=torch.float64)
    b = torch.full_like(w, math.log(rate / (1 - rate)))  # start at the base rate
    objective = _logistic_objective(x, y, w, b, C)
    active = torch.ones_like(w, dtype=torch.bool)  # columns still being optimised
    for _ in range(max_iter):
        p = torch.sigmoid(x * w + b)
        r, s = p - y[:, None], p * (1 - p)
        g_w, g_b = (r * x).sum(0) + w / C, r.sum(0)
        active &= (g_w.abs() + g_b.abs()) >= 1e-9 * len(y)  # per-column convergence
        if not active.any():
            break
        h_ww, h_wb, h_bb = (s * x * x).sum(0) + 1 / C, (s * x).sum(0), s.sum(0)
        det = h_ww * h_bb - h_wb**2
        step_w, step_b = (h_bb * g_w - h_wb * g_b) / det, (h_ww * g_b - h_wb * g_w) / det
        t = active.double()
        # Near the optimum a full Newton step may look worse by rounding alone: tolerate that.
        tolerance = 1e-12 * objective.abs()
        for _ in range(30):  # halve each column's step until its objective does not increase
            trial = _logistic_objective(x, y, w - t * step_w, b - t * step_b, C)
            worse = trial > objective + tolerance
            if not worse.any():
                break
            t = torch.where(worse, t / 2, t)
        t = torch.where(worse, torch.zeros_like(t), t)  # no acceptable step: at its optimum
        active &= ~worse
        w, b = w - t * step_w, b - t * step_b
        objective = torch.where(worse, objective, trial)
    return w, b


def logistic_log_loss(x: Tensor, y: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """Mean log-loss (nats) of each column's 1-D probe: `(N, M), (N,) -> (M,)`."""
    z = x.double() * w + b
    return (torch.logaddexp(torch.zeros_like(z), z) - y.double()[:, None] * z).mean(0)


class ProbeResult(NamedTuple):
    loss: float
    """median over classes of the best concept's test log-loss"""
    per_class: Tensor
    """`(n_classes,)` test log-loss of each class's best concept"""
    best_concept: Tensor
    """`(n_classes,)` index of the concept with the lowest train log-loss, per class"""
    classes: Tensor
    """`(n_classes,)` the label values, sorted"""


def probe_loss(z_train: Tensor, y_train: Tensor, z_test: Tensor, y_test: Tensor, C: float = 1.0) -> ProbeResult:
    """The Deleuzian paper's probe loss (000, SPECS.md): how well the single best concept predicts a label.

        probe_loss(z_tr, y_tr, z_te, y_te).loss       # z: (N, n_concepts), y: (N,) labels

    For each label value (one-vs-rest) and each concept, fit a 1-D logistic regression (L2, C) on
    the train split's raw activations, as the paper's released probes fit scikit-learn's
    `LogisticRegression()`; the concept with the lowest train log-loss is that class's probe,
    scored by its test log-loss. The result is the median over classes (a binary label gives two
    equal one-vs-rest problems). Lower is better; ln 2 = 0.693 is chance for balanced classes. A
    label value missing from either split is left out (as the released probes do): its test loss
    would be that of an empty class. With the penalty the value depends on each concept's scale;
    `standardised_probe_loss` is the scale-free variant the atlas and the quality table use.
    """
    return _probe_loss(z_train, y_train, z_test, y_test, C, standardise=False)


def standardised_probe_loss(z_train: Tensor, y_train: Tensor, z_test: Tensor, y_test: Tensor,
                            C: float = 1.0) -> ProbeResult:
    """`probe_loss` on columns standardised by the train split (`standardised_by`): ours, not the
    paper's. Why: the L2 penalty then weighs every concept alike whatever its scale (a cosine in
    [-1, 1], an SAE latent, a raw projection), so sets read in different units compare by what
    their concepts carry, not by their units. The describe pass's per-class probes are the same."""
    return _probe_loss(z_train, y_train, z_test, y_test, C, standardise=True)


def _probe_loss(z_train: Tensor, y_train: Tensor, z_test: Tensor, y_test: Tensor, C: float,
                standardise: bool) -> ProbeResult:
    classes = torch.unique(y_train)
    if len(classes) < 2:
        raise ValueError(f"y_train needs at least two label values; got {classes.tolist()}")
    classes = classes[torch.isin(classes, y_test.to(classes.device))]
    if not len(classes):
        raise ValueError(f"no label value of y_train appears in y_test ({torch.unique(y_test).tolist()})")
    z_train, z_test = standardised_by(z_train, z_test) if standardise else (z_train.double(), z_test.double())
    per_class, best = [], []
    for c in classes:
        yc_train, yc_test = (y_train == c).double(), (y_test == c).double()
        step, train_loss, params = _chunk(len(y_train)), [], []
        for cols in z_train.split(step, dim=1):
            w, b = fit_logistic_1d(cols, yc_train, C=C)
            train_loss.append(logistic_log_loss(cols, yc_train, w, b))
            params.append((w, b))
        w, b = (torch.cat(t) for t in zip(*params))
        j = int(torch.cat(train_loss).argmin())
        best.append(j)
        per_class.append(logistic_log_loss(z_test[:, j:j + 1], yc_test, w[j:j + 1], b[j:j + 1])[0])
    per_class_t = torch.stack(per_class)
    # torch.median takes the lower middle value; average the two middles like numpy
    return ProbeResult(float(per_class_t.quantile(0.5)), per_class_t, torch.tensor(best), classes)


def standardised_by(train: Tensor, test: Tensor) -> tuple[Tensor, Tensor]:
    """Both `(N, M)` minus the train columns' mean, over their (biased) std (1 where constant)."""
    train, test = train.double(), test.double()
    mean = train.mean(0)
    std = (train - mean).pow(2).mean(0).sqrt()
    std = torch.where(std > 0, std, torch.ones_like(std))
    return (train - mean) / std, (test - mean) / std


def _standardise(z: Tensor) -> Tensor:
    """Zero mean, unit (biased) std per column; constant columns become zeros."""
    z = z.double() - z.double().mean(0)
    std = z.pow(2).mean(0).sqrt()
    return z / torch.where(std > 0, std, torch.ones_like(std))


def mppc(z_a: Tensor, z_b: Tensor) -> float:
    """Mean max Pearson correlation (Deleuzian concepts, 000): how well run b's concepts are found in run a.

        mppc(z_run1, z_run2)      # z: (N, n_concepts) activations of both runs on the SAME tokens

    With each run's activations z-scored, R = Za^T Zb / N and MPPC = mean_j max_i R_ij: the mean over
    run b's concepts of the highest Pearson correlation with any concept of run a (as the paper and
    its released code). Asymmetric when the runs differ in concept count; 1.0 when every concept of
    b is an exact (affine) copy of one in a. A constant concept has no correlation; it counts as 0.
    """
    if z_a.shape[0] != z_b.shape[0]:
        raise ValueError(f"runs must be evaluated on the same tokens; got {z_a.shape[0]} and {z_b.shape[0]} rows")
    a, b = _standardise(z_a), _standardise(z_b)
    best = torch.cat([(a.T @ cols / len(a)).max(0).values for cols in b.split(_chunk(len(b)), dim=1)])
    return float(best.mean())


def effective_rank(directions: Tensor, site: Any = None, *, unit: bool = False) -> float:
    """exp(entropy of the normalised singular values) of `(n, d)`: how many directions the
    concepts really span (Roy & Vetterli 2007; the Deleuzian paper's, of C as given); between 1 and
    min(n, d). `unit=True`: of the rows scaled to unit length, the quality tables' figure (the span's
    shape, whatever the rows' lengths). Gauge-dependent at a q/k `site` (GaugeWarning)."""
    warn_if_qk(site, "effective rank")
    directions = directions.double()
    s = torch.linalg.svdvals(torch.nn.functional.normalize(directions, dim=1) if unit else directions)
    p = s[s > 0] / s.sum()
    return float(torch.exp(-(p * p.log()).sum()))


def max_pairwise_cosine(directions: Tensor, site: Any = None) -> Tensor:
    """For each direction `(n, d)`, the largest cosine with any OTHER direction: `(n,)`.
    Near 1 flags duplicated concepts. Gauge-dependent at a q/k `site` (GaugeWarning)."""
    warn_if_qk(site, "cosine")
    unit = torch.nn.functional.normalize(directions.double(), dim=1)
    cos = unit @ unit.T
    cos.fill_diagonal_(-math.inf)
    return cos.max(1).values


def fvu(x: Tensor, x_hat: Tensor) -> float:
    """Fraction of variance unexplained: sum |x - x_hat|^2 / sum |x - mean(x)|^2, x `(N, d)`."""
    x, x_hat = x.double(), x_hat.double()
    return float((x - x_hat).pow(2).sum() / (x - x.mean(0)).pow(2).sum())


def l0(z: Tensor) -> float:
    """Mean number of nonzero concept activations per token, z `(N, n_concepts)`."""
    return float((z != 0).sum(1).double().mean())


def dead_fraction(z: Tensor) -> float:
    """Fraction of concepts that never fire (are zero on every token) in z `(N, n_concepts)`."""
    return float((~(z != 0).any(0)).double().mean())


def best_latent_f1(z: Tensor, labels: Tensor) -> Tensor:
    """Per concept c, the best F1 over latents j of "latent j fires (z_j > 0)" as a detector of
    label == c (SpaDE, 001): `(n_concepts,)` for z `(N, width)`, labels `(N,)` in 0..n_concepts-1."""
    fired = (z > 0).float()
    scores = []
    for c in range(int(labels.max()) + 1):
        y = (labels == c).float()[:, None]
        tp = (fired * y).sum(0)
        precision, recall = tp / fired.sum(0).clamp(min=1), tp / y.sum()
        scores.append((2 * precision * recall / (precision + recall).clamp(min=1e-12)).max())
    return torch.stack(scores)


def ce_loss_recovered(clean: float, spliced: float, zero_ablated: float) -> float:
    """(L_zero - L_spliced) / (L_zero - L_clean): 1 = splicing in the reconstruction costs
    nothing, 0 = as bad as zeroing the site."""
    if zero_ablated == clean:
        raise ValueError(f"zero-ablated loss equals the clean loss ({clean}); the ratio is undefined")
    return (zero_ablated - spliced) / (zero_ablated - clean)


class LDADirections(NamedTuple):
    directions: Tensor
    """`(n_classes, d)` unit vectors, each pointing from the other classes towards its class"""
    classes: Tensor
    """`(n_classes,)` the label values, sorted"""


def lda_directions(x: Tensor, y: Tensor, shrinkage: float = 0.1) -> LDADirections:
    """Supervised reference directions: one-vs-rest linear discriminants with shrinkage.

        ref = lda_directions(x, labels)          # x: (N, d), labels: (N,)
        ConceptSet(ref.directions, site=...)     # compare extracted concepts against these

    For class c: w = S^-1 (mu_c - mu_rest), S the prior-weighted within-class covariance of
    {c, rest} shrunk towards a scaled identity ((1 - a) S + a tr(S)/d I), as in sklearn's
    `LinearDiscriminantAnalysis(solver="lsqr", shrinkage=a)`; normalised to unit length.
    """
    if not 0 <= shrinkage <= 1:
        raise ValueError(f"shrinkage must be in [0, 1]; got {shrinkage}")
    x = x.double()
    classes = torch.unique(y)
    d = x.shape[1]
    out = []
    for c in classes:
        groups = [x[y == c], x[y != c]]
        if any(len(g) == 0 for g in groups):
            raise ValueError(f"class {c.item()} needs examples on both sides; labels are {classes.tolist()}")
        cov = torch.stack([len(g) / len(x) * torch.cov(g.T, correction=0).reshape(d, d) for g in groups]).sum(0)
        cov = (1 - shrinkage) * cov + shrinkage * cov.trace() / d * torch.eye(d, dtype=x.dtype)
        w = torch.linalg.lstsq(cov, groups[0].mean(0) - groups[1].mean(0)).solution
        out.append(w / w.norm())
    return LDADirections(torch.stack(out), classes)
