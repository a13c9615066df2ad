"""SAELens's synthetic activations (SynthSAEBench) as one seeded stream, and its own SAE trainer on it.

    model = synthetic_model(SyntheticConfig())          # a sae_lens.synthetic.SyntheticModel
    features = SeededFeatures(model.activation_generator, seed=0)
    x = model.feature_dict(features(1024))              # (1024, hidden_dim) rows; batch i is fixed by (seed, i)
    sae = train_saelens(model, config, seed=0)          # SAELens's SyntheticSAERunner on the same rows

The generator has the three properties of SAELens's benchmark: superposition (more features
than dimensions), a hierarchy (children fire only with their parent; half the parents' children
are mutually exclusive) and low-rank correlated firing, with Zipfian firing probabilities and
noisy magnitudes. Batch i of a stream is the generator sampled under the seed (seed, i) with the
global torch RNG forked, so any consumer asking for the same batch sizes gets the same rows:
SAELens's runner and our extractors see identical activations without storing them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

METHODS = ("topk", "batchtopk", "jumprelu", "relu", "matryoshka", "spade", "kmeans", "deleuzian", "vq")
"""Our extractors that yield directions, in the order of the table."""


@dataclass
class SyntheticConfig:
    """The synthetic benchmark's size and budget (defaults: a few minutes on 2 cores)."""

    num_features: int = 256
    """Ground-truth features (the dictionary size every extractor is given)."""
    hidden_dim: int = 64
    """Width of the activations: num_features / hidden_dim is the superposition."""
    k: int = 8
    """Active latents per row of the TopK-style SAEs (ours and SAELens's)."""
    steps: int = 200
    """Training batches per fit (SAELens's runner takes one step per batch)."""
    batch_size: int = 1024
    eval_rows: int = 16_384
    """Held-out rows of the per-latent F1 (the same rows for every fit)."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """One fit of every extractor per seed, on that seed's stream; intervals are over seeds."""
    methods: tuple[str, ...] = METHODS
    model_seed: int = 0
    """Seed of the generator itself (features, hierarchy, correlations): one benchmark for all seeds."""

    def __post_init__(self) -> None:
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise ValueError(f"unknown synthetic methods {bad or '(none)'}; choose from {', '.join(METHODS)}")
        for name in ("num_features", "hidden_dim", "k", "steps", "batch_size", "eval_rows"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer; got {getattr(self, name)!r}")
        if self.k > self.num_features:
            raise ValueError(f"k must be at most num_features={self.num_features}; got {self.k}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ValueError(f"seeds must be distinct non-negative integers; got {list(self.seeds)}")


def synthetic_model(config: SyntheticConfig) -> Any:
    """SAELens's `SyntheticModel`: hierarchy, correlation and superposition at `config`'s size."""
    from sae_lens.synthetic import (HierarchyConfig, LowRankCorrelationConfig, SyntheticModel, SyntheticModelConfig,
                                    ZipfianFiringProbabilityConfig)

    n = config.num_features
    cfg = SyntheticModelConfig(
        num_features=n, hidden_dim=config.hidden_dim,
        firing_probability=ZipfianFiringProbabilityConfig(exponent=0.5, max_prob=0.3, min_prob=0.01),
        hierarchy=HierarchyConfig(total_root_nodes=max(n // 16, 1), branching_factor=4, max_depth=1,
                                  mutually_exclusive_portion=0.5),
        correlation=LowRankCorrelationConfig(rank=16, correlation_scale=0.1, seed=model_seed(config.model_seed)),
        std_firing_magnitudes=0.3, mean_firing_magnitudes=1.0, bias=1.0, seed=model_seed(config.model_seed))
    return SyntheticModel(cfg)


def model_seed(seed: int) -> int:
    """The generator's torch seed, apart from the fits' seeds: SAELens draws the feature vectors with
    torch.randn under it, as our SAEs draw their first decoder, so equal seeds start a fit at the answer."""
    from numpy.random import SeedSequence

    return int(SeedSequence([seed, 1 << 20]).generate_state(1)[0])


class SeededFeatures:
    """A stream of feature activations whose batch i is fixed by (seed, i); callable like
    SAELens's `ActivationGenerator` (`features(batch_size)`, `features.sample(batch_size)`)."""

    def __init__(self, generator: Any, seed: int) -> None:
        self.generator, self.seed, self.batches = generator, seed, 0

    def sample(self, batch_size: int) -> Tensor:
        """`(batch_size, num_features)` activations of the next batch."""
        from numpy.random import SeedSequence

        # torch's CPU generator keeps 32 bits of a seed: mix (seed, batch) into them
        mixed = int(SeedSequence([self.seed, self.batches]).generate_state(1)[0])
        with torch.random.fork_rng(devices=[]):  # the caller's RNG is left as it was
            torch.manual_seed(mixed)
            self.batches += 1
            return self.generator.sample(batch_size)

    __call__ = sample


def replayed(model: Any, seed: int) -> Any:
    """`model` whose activation generator is the seeded stream `seed` (shares its dictionary)."""
    from sae_lens.synthetic import SyntheticModel

    return SyntheticModel(model.cfg, feature_dict=model.feature_dict, hierarchy=model.hierarchy,
                          correlation_matrix=model.correlation_matrix,
                          activation_generator=SeededFeatures(model.activation_generator, seed))


def train_saelens(model: Any, config: SyntheticConfig, seed: int, lr: float) -> Any:
    """A TopK SAE (k, width = num_features) trained by SAELens's `SyntheticSAERunner` on stream `seed`:
    `config.steps` batches of `config.batch_size`, Adam at `lr`, SAELens's other defaults."""
    from sae_lens import TopKTrainingSAEConfig
    from sae_lens.config import LoggingConfig
    from sae_lens.synthetic import SyntheticSAERunner, SyntheticSAERunnerConfig

    sae_cfg = TopKTrainingSAEConfig(d_in=config.hidden_dim, d_sae=config.num_features, k=config.k)
    cfg = SyntheticSAERunnerConfig(synthetic_model=model.cfg, sae=sae_cfg, batch_size=config.batch_size,
                                   training_samples=config.steps * config.batch_size, lr=lr, output_path=None,
                                   checkpoint_path=None, run_final_eval=False, eval_samples=0,
                                   logger=LoggingConfig(log_to_wandb=False))
    with torch.random.fork_rng(devices=[]):  # the SAE's initialisation is seeded too
        torch.manual_seed(seed)
        return SyntheticSAERunner(cfg, override_synthetic_model=replayed(model, seed)).run().sae
