"""Ground-truth recovery on SAELens's synthetic benchmark: MCC and F1 of every extractor of ours
next to a TopK SAE trained by SAELens's own synthetic runner, on the same generated activations.

    lines = synthetic_lines(SyntheticConfig(seeds=(0, 1, 2)))     # `conceptlens eval --suite synthetic`
    print(format_lines(lines))

Per seed, one stream of rows (see `synthetic_data`) goes once through every extractor (each
batch to all of them in turn) and, replayed, through SAELens's `SyntheticSAERunner`; every
dictionary has as many directions as the generator has features. Figures (SAELens's own
definitions, `sae_lens.synthetic.evals`):
- MCC: `mean_correlation_coefficient`, the mean |cosine| of a one-to-one (Hungarian) matching
  of the set's directions to the true feature vectors (Ma et al. 2025, arXiv 2505.20254);
- F1: `compute_classification_metrics`: each latent is a detector of its best-matching feature
  (largest |cosine|); F1 of "latent fires" against "feature > 0" on held-out rows, averaged over
  latents. A latent fires where the set's activation is nonzero (SAE encoders); sets with dense
  activations (k-means, Deleuzian, VQ) fire on the concept each row is assigned to (nearest centre,
  or largest cosine: `describe.activations`), a one-hot code.
Directions are the ones the atlas uses (`describe.activations`: unit, centred on the fit's mean
when the set carries one). Intervals: mean over seeds +- Student's t (95%, n - 1 degrees of
freedom) times the standard error. Controls: random unit directions (as many), scored the same way.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.evaluate.bootstrap import Estimate
from conceptlens.evaluate.lines import Line
from conceptlens.evaluate.synthetic_data import (METHODS, SeededFeatures, SyntheticConfig, synthetic_model,
                                                 train_saelens)

__all__ = ["METHODS", "Recovery", "SyntheticConfig", "recovery", "seed_interval", "synthetic_lines"]
EVAL_SEED = 2**31 - 1
"""Stream of the held-out rows, apart from every training seed."""
PEER = "SAELens topk"


class Recovery(NamedTuple):
    mcc: float
    f1: float
    l0: float
    """mean active latents per held-out row"""


def recovery(directions: Tensor, latents: Tensor, features: Tensor, truth: Tensor) -> Recovery:
    """SAELens's MCC and mean per-latent F1 of a dictionary.

    directions `(n, d)`, latents `(N, n)` on held-out rows whose true feature activations are
    `features` `(N, F)`; truth `(F, d)` the true feature vectors."""
    from sae_lens.synthetic import compute_classification_metrics, mean_correlation_coefficient

    mcc = mean_correlation_coefficient(directions.float(), truth.float())
    f1 = compute_classification_metrics(latents, features, directions.float(), truth.float()).f1_score
    return Recovery(mcc, f1, float((latents != 0).sum(1).float().mean()))


def set_latents(cs: ConceptSet) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
    """A set's directions `(n, d)` and its latents `(N, d) -> (N, n)`: the encoder of a sparse set,
    else the one-hot concept each row is assigned to."""
    from conceptlens.describe.activations import concept_activations

    act = concept_activations(cs)
    if act.sparse:
        return act.directions, act.encode

    assign = act.assign_fn
    if assign is None:
        raise ValueError(f"{cs.method}: a dense set without an assignment rule")

    def one_hot(x: Tensor) -> Tensor:
        return torch.nn.functional.one_hot(assign(act.encode(x), x), cs.directions.shape[0]).float()
    return act.directions, one_hot


def extractor(method: str, config: SyntheticConfig, seed: int) -> Any:
    """Our `method` at the benchmark's width (SAEs: its batch, warm-up over the first batch), its own
    defaults otherwise."""
    from conceptlens import concepts as c

    width, k = config.num_features, config.k
    sae: dict[str, Any] = dict(width=width, batch_size=config.batch_size, warmup_tokens=config.batch_size, seed=seed)
    makers: dict[str, Callable[[], Any]] = {
        "topk": lambda: c.TopKSAE(k=k, **sae), "batchtopk": lambda: c.BatchTopKSAE(k=k, **sae),
        "jumprelu": lambda: c.JumpReLUSAE(**sae), "relu": lambda: c.ReLUSAE(**sae),
        "matryoshka": lambda: c.MatryoshkaSAE(k=k, **sae), "spade": lambda: c.SpaDE(**sae),
        "kmeans": lambda: c.StreamingKMeans(width, seed=seed), "deleuzian": lambda: c.Deleuzian(width, seed=seed),
        "vq": lambda: c.VQCodebook(width, seed=seed)}
    return makers[method]()


def fit_seed(model: Any, config: SyntheticConfig, seed: int) -> dict[str, ConceptSet]:
    """Every method of `config` fitted on stream `seed` (each batch to all of them)."""
    fits = {m: extractor(m, config, seed) for m in config.methods}
    stream = SeededFeatures(model.activation_generator, seed)
    for _ in range(config.steps):
        with torch.no_grad():
            x = model.feature_dict(stream(config.batch_size))  # (B, hidden_dim)
        for fit in fits.values():
            fit.update(x)
    for fit in fits.values():
        fit.flush()
    return {m: fit.concept_set() for m, fit in fits.items()}


def random_set(config: SyntheticConfig, seed: int) -> ConceptSet:
    """As many Gaussian directions as the generator has features, from a seed of their own (SAELens
    draws its feature vectors with torch.randn under the model's seed: the same seed would replay them)."""
    from numpy.random import SeedSequence

    g = torch.Generator().manual_seed(int(SeedSequence([seed, EVAL_SEED]).generate_state(1)[0]))
    return ConceptSet(torch.randn(config.num_features, config.hidden_dim, generator=g), method="random")


def seed_interval(values: list[float]) -> Estimate:
    """Mean over seeds with its 95% Student-t interval (no interval from one seed)."""
    from scipy.stats import t

    v = torch.tensor(values, dtype=torch.float64)
    mean = float(v.mean())
    if len(v) < 2:
        return Estimate(mean, math.nan, math.nan)
    half = float(t.ppf(0.975, len(v) - 1) * v.std() / math.sqrt(len(v)))
    return Estimate(mean, mean - half, mean + half)


def synthetic_lines(config: SyntheticConfig, progress: Callable[[str], None] | None = None) -> list[Line]:
    """MCC and F1 of every method and of SAELens's TopK SAE, over `config.seeds`, as suite lines
    (baselines: SAELens's SAE, then random directions)."""
    from conceptlens.concepts.sae.config import SAEConfig

    model = synthetic_model(config)
    truth = model.feature_dict.feature_vectors.detach()  # (F, d)
    with torch.no_grad():
        features = SeededFeatures(model.activation_generator, EVAL_SEED)(config.eval_rows)  # (N, F)
        x = model.feature_dict(features)  # (N, d)
    lr = SAEConfig(width=config.num_features).learning_rate()  # our SAEs' default, given to SAELens's too
    scores: dict[str, list[Recovery]] = {}
    for seed in config.seeds:
        sets = fit_seed(model, config, seed)
        sets["random directions"] = random_set(config, seed)
        for name, cs in sets.items():
            directions, encode = set_latents(cs)
            scores.setdefault(name, []).append(recovery(directions, encode(x), features, truth))
        sae = train_saelens(model, config, seed, lr)
        with torch.no_grad():
            scores.setdefault(PEER, []).append(recovery(sae.W_dec.detach(), sae.encode(x), features, truth))
        if progress is not None:
            progress(f"seed {seed}: " + ", ".join(f"{n} MCC {s[-1].mcc:.3f}" for n, s in scores.items()))
    return _lines(scores, config)


def _lines(scores: dict[str, list[Recovery]], config: SyntheticConfig) -> list[Line]:
    true_l0 = f"{config.num_features} features in {config.hidden_dim} dims, {len(config.seeds)} seeds"
    lines = []
    for metric in ("mcc", "f1"):
        est = {name: seed_interval([getattr(s, metric) for s in runs]) for name, runs in scores.items()}
        for name in (*config.methods, PEER):
            bases = [(b, est[b]) for b in (PEER, "random directions") if b != name]
            l0 = sum(s.l0 for s in scores[name]) / len(scores[name])
            lines.append(Line(name, f"synthetic {metric.upper()}", est[name], bases, f"L0 {l0:.1f}; {true_l0}"))
    return lines
