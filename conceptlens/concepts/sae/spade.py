"""SpaDE: a distance-based sparse encoder whose latents are prototypes (Hindupur et al. 2025).

    sae = SpaDE(width=512, gamma=0.1, seed=0)

z = sparsemax(-lambda ||x - w_i||^2) puts each token on the simplex over its nearest
prototypes, so a latent fires on a bounded region around w_i rather than on a half-space.
That is what lets SpaDE separate concepts that a linear-threshold encoder cannot, such as
concepts that differ only in magnitude along one direction. The decoder is x_hat = z A,
with no biases; the loss adds gamma * sum_i z_i ||x - w_i||^2, which pulls every active
prototype toward the tokens it encodes.

Inputs are standardised over the first `warmup_tokens` rows (then frozen, so a fit stays
deterministic and resumes bit for bit): x_n = (x - mu) / sigma with mu the mean of each feature
and, by default (`standardise="isotropic"`), one sigma for all features (E||x_n||^2 = d), or
with `standardise="features"` each feature's own standard deviation, as in the paper. mu and
sigma are kept with the state and folded into the export: the ConceptSet's prototypes are
raw-space points mu + sigma w_i, distances are measured in units of sigma
(||(x - p_i) / sigma||^2), and the decoder is x_hat = z (sigma A) + mu (`input_mean`,
`input_std` in the encoder).

Two departures from the paper make its gamma 0.1 work on short streams: the prototypes start
at k-means++ (D^2-sampled) tokens of the first batch rather than uniform ones (so every
concept has a prototype nearby), and lambda starts at 1 / the median squared distance from a
token to its nearest other prototype rather than 1 / (2d) (`initial_lambda`). With the paper's
choices SpaDE separated magnitude-only concepts no better than a ReLU SAE (best-latent F1
0.66 on 8 rays x 3 magnitudes in d = 32, 96k rows, 5 passes, width 48); with these, 0.99-1.0
(tests/concepts/sae/test_planted.py). Per-feature standardisation is not the default: it
made no difference there (0.99-1.0 either way) and it breaks concepts that live on a few
features, because it scales noise-only features up to the signal's size (4 magnitudes on one
axis of d = 16: F1 0.43 per feature, 1.0 isotropic). k-means++ starts also fix the width =
number of concepts case, where uniform starts often put two prototypes in one concept (4
magnitudes, width 4, 20k rows: F1 1.0, was 0.50; reproductions/spade_f1.py).

It trains with every SAE's optimiser (`SAETrainer`: Adam at a constant lr, by default the
width rule's; `conceptlens fit` gives its budget rule), not the paper's (Adam lr 1e-2 decaying
by a cosine to 1e-4, gradients clipped at norm 1.0): a stream has no known length to decay
over. `reproductions/spade_f1.py` passes lr=1e-2, the paper's starting lr, and no schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from conceptlens.concepts.kmeans import batched_seeds, squared_distances
from conceptlens.concepts.sae.base import Code, SparseAutoencoder
from conceptlens.concepts.sae.config import SAEConfig, check_choice, check_float
from conceptlens.concepts.sae.sparsemax import sparsemax


@dataclass(kw_only=True)
class SpaDEConfig(SAEConfig):
    """SpaDE hyper-parameters."""

    gamma: float = 0.1
    """Weight of the distance term sum_i z_i ||x - w_i||^2."""
    standardise: Literal["isotropic", "features"] = "isotropic"
    """Input standardisation over the warm-up: subtract each feature's mean, then divide by one
    scale for all features ("isotropic": Euclidean geometry kept) or by each feature's standard
    deviation ("features", the paper's)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float("gamma", self.gamma)
        check_choice("standardise", self.standardise, ("isotropic", "features"))


class SpaDE(SparseAutoencoder):
    """z = sparsemax(-lambda ||x - w_i||^2), x_hat = z A; loss ||x - x_hat||^2 + gamma sum_i z_i ||x - w_i||^2."""

    Config = SpaDEConfig
    method = "spade"
    unit_decoder = False
    config: SpaDEConfig

    def _init_params(self, x: Tensor) -> dict[str, Tensor]:
        """Prototypes and decoder rows start at distinct tokens of the first (standardised) batch,
        drawn by k-means++ D^2 sampling (a batch smaller than the width is reused whole, then
        again, in random order); lambda = 1 / the median squared distance from a token to its
        nearest other prototype (see `initial_lambda`)."""
        n, width = x.shape[0], self.config.width
        if n >= width:
            rows = batched_seeds(x, width, self.trainer.generator)
        else:
            g = self.trainer.generator
            rows = torch.cat([torch.randperm(n, generator=g) for _ in range(-(-width // n))])[:width]
        rows = rows.to(x.device)
        prototypes = x[rows]  # (width, d)
        lam = initial_lambda(x, prototypes, rows)
        return {"prototypes": prototypes.cpu().clone(), "lambda_pre": torch.tensor(math.log(math.expm1(lam))),
                "W_dec": prototypes.cpu().clone()}

    def _weights(self) -> dict[str, Tensor]:
        return {"prototypes": self.params["prototypes"], "lambda": F.softplus(self.params["lambda_pre"]),
                "W_dec": self.params["W_dec"]}

    def _encode(self, x: Tensor, w: dict[str, Tensor], train: bool) -> Code:
        prototypes = w["prototypes"]
        if "input_std" in w:  # raw space: distances in units of each feature's sigma
            x, prototypes = x / w["input_std"], prototypes / w["input_std"]
        pre = -w["lambda"] * squared_distances(x, prototypes)  # (N, width)
        return Code(sparsemax(pre), pre)

    def _decode(self, z: Tensor, w: dict[str, Tensor], train: bool = False) -> Tensor:
        x_hat = z.to(w["W_dec"].dtype) @ w["W_dec"]  # (N, d)
        return x_hat + w["input_mean"] if "input_mean" in w else x_hat

    def _penalty(self, x: Tensor, x_hat: Tensor, code: Code, w: dict[str, Tensor]) -> Tensor:
        distances = -code.pre / w["lambda"]  # (B, width)
        return self.config.gamma * (code.z * distances).sum(-1).mean()

    # ---- per-feature standardisation ------------------------------------------------------
    def _warm_up(self, rows: Tensor) -> None:
        """Sum each feature and its square (float64) over the warm-up rows."""
        rows = rows.double()
        moments = torch.stack([rows.sum(0), rows.pow(2).sum(0)]).cpu()  # (2, d)
        if self.comm is not None:
            moments = self.comm.sum_(moments)
        if "warm_moments" in self.buffer_dict:
            moments = self.buffer_dict["warm_moments"] + moments
        self.buffer_dict["warm_moments"] = moments

    def _set_scale(self, sum_sq: float, rows: int) -> None:
        """mu and sigma from the warm-up sums; a constant feature (or input) keeps sigma = 1."""
        super()._set_scale(sum_sq, rows)
        n, moments = rows, self.buffer_dict.pop("warm_moments")
        mean = moments[0] / n  # (d,)
        var = (moments[1] / n - mean.pow(2)).clamp(min=0)  # (d,)
        std = var.sqrt() if self.config.standardise == "features" else var.mean().sqrt().expand_as(var).clone()
        std = torch.where(std > 1e-6 * std.max(), std, torch.ones_like(std))
        device = self.tensor_device
        self.buffer_dict = {"input_mean": mean.float().to(device), "input_std": std.float().to(device)}

    def _normalise(self, x: Tensor) -> Tensor:
        return (x - self.buffer_dict["input_mean"]) / self.buffer_dict["input_std"]

    def _merge(self, other: SparseAutoencoder) -> None:
        """As the base; two replicas still warming up also pool their per-feature sums."""
        if not self.params and not other.params and self.scale is None and other.d is not None:
            if other.scale is not None:
                self.buffer_dict = {k: v.clone() for k, v in other.buffer_dict.items()}
            elif "warm_moments" in other.buffer_dict:
                theirs = other.buffer_dict["warm_moments"]
                self.buffer_dict["warm_moments"] = theirs.clone() + self.buffer_dict.get("warm_moments", 0)
        super()._merge(other)

    def _fold(self, w: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
        """x_n = (x - mu) / sigma: ||x_n - w||^2 = ||(x - (mu + sigma w)) / sigma||^2 and
        x_hat = mu + sigma (z A); `scale` (the scalar the other SAEs use) plays no part."""
        mean, std = self.buffer_dict["input_mean"], self.buffer_dict["input_std"]
        return {"prototypes": mean + std * w["prototypes"], "lambda": w["lambda"], "W_dec": std * w["W_dec"],
                "input_mean": mean, "input_std": std}


def initial_lambda(x: Tensor, prototypes: Tensor, rows: Tensor) -> float:
    """1 / median_i min_j ||x_i - w_j||^2 over the prototypes w_j `(width, d)` that are not row i
    itself (`rows` `(width,)`: the row of x `(N, d)` each prototype was taken from).

    The paper's 1 / (2d) is 1 / E||x - w||^2 for a random prototype of standardised data: the
    codes start dense and, with Adam moving lambda's pre-activation by at most lr per step, stay
    dense for the few hundred steps of a short stream (best-latent F1 0.66 on magnitude
    concepts). Scaled by the nearest prototype instead, a token starts on a few prototypes.
    Falls back to 1 / (2d) when every token coincides with a prototype.
    """
    d2 = squared_distances(x, prototypes)  # (N, width)
    d2[rows[None, :] == torch.arange(x.shape[0], device=x.device)[:, None]] = float("inf")
    nearest = d2.min(1).values
    median = float(nearest[nearest.isfinite()].median()) if nearest.isfinite().any() else 0.0
    return 1 / median if median > 0 else 1 / (2 * x.shape[1])
