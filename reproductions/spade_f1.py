"""Claim (SpaDE, 001): best-latent F1 on linearly vs nonlinearly separable synthetic concepts.

Paper: ReLU and JumpReLU 1.0 / ~0.5, TopK ~0.7 / ~0.7, SpaDE 1.0 / 1.0.

    python reproductions/spade_f1.py [TOKENS]   # TOKENS training rows per fit, default 100000;
                                                # 20000 takes 3.5 minutes on the shared 2 cores

Two synthetic sets of 4 concepts in d = 16 with small isotropic noise:
- linear: each concept a cluster at +2 along its own axis (a half-space isolates each);
- nonlinear: the 4 concepts at magnitudes 1, 2, 3, 4 along ONE axis (no half-space isolates the
  middle ones; a bounded cell does).
Best-latent F1: for each concept, the best F1 of "latent j fires" as its detector; mean over
concepts. Widths 4 (= the number of concepts) and 16. Then a third set at every model's
defaults (but the width): 8 rays x 3 magnitudes in d = 32, 96k rows, 5 passes, width 48.
"""

from __future__ import annotations

import sys

import torch

from _common import Clock, report, threads

from conceptlens.concepts.sae import JumpReLUSAE, ReLUSAE, SpaDE, TopKSAE
from conceptlens.metrics.quality import best_latent_f1


def linear_concepts(n: int, g: torch.Generator, d: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.randint(4, (n,), generator=g)
    x = 0.05 * torch.randn(n, d, generator=g)
    x[torch.arange(n), labels] += 2.0
    return x, labels


def magnitude_concepts(n: int, g: torch.Generator, d: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.randint(4, (n,), generator=g)
    x = 0.05 * torch.randn(n, d, generator=g)
    x[:, 0] += labels.float() + 1
    return x, labels


def models(width: int, seed: int) -> dict:
    common = dict(width=width, batch_size=256, warmup_tokens=256, dead_after=5000, lr=1e-2, seed=seed)
    return {
        "ReLU": lambda: ReLUSAE(**common),
        "JumpReLU": lambda: JumpReLUSAE(**common, l0=0.05, threshold_init=0.5, bandwidth=0.1),
        "TopK (k=1)": lambda: TopKSAE(**common, k=1),
        "SpaDE gamma=0.1": lambda: SpaDE(**common, gamma=0.1),
        "SpaDE gamma=1": lambda: SpaDE(**common, gamma=1.0),
    }


def ray_concepts(n: int, rays: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.randint(3 * rays.shape[0], (n,), generator=g)
    magnitude = (labels % 3 + 1).float()
    return magnitude[:, None] * rays[labels // 3] + 0.05 * torch.randn(n, rays.shape[1], generator=g), labels


def rays_at_defaults(clock: Clock) -> list[tuple]:
    rows = []
    for seed in (2, 3):
        g = torch.Generator().manual_seed(seed)
        rays = torch.nn.functional.normalize(torch.randn(8, 32, generator=g), dim=1)
        x, _ = ray_concepts(96_000, rays, g)
        x_test, y_test = ray_concepts(8000, rays, g)
        for name, make in (("SpaDE", lambda: SpaDE(width=48, seed=seed)), ("ReLU", lambda: ReLUSAE(width=48, seed=seed)),
                           ("TopK (k=1)", lambda: TopKSAE(width=48, k=1, seed=seed))):
            sae = make()
            for _ in range(5):
                for chunk in x.split(2000):
                    sae.update(chunk)
            sae.flush()
            f1 = float(best_latent_f1(sae.encode(x_test), y_test).mean())
            rows.append((seed, name, f1))
            print(f"  [{clock}] rays seed {seed} {name}: {f1:.3f}", flush=True)
    return rows


def main() -> None:
    threads(2)
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    clock, rows = Clock(), []
    for width in (4, 16):
        for name in models(width, 0):
            cells = []
            for make in (linear_concepts, magnitude_concepts):
                scores = []
                for seed in (0,):
                    g = torch.Generator().manual_seed(seed)
                    x, _ = make(tokens, g)
                    x_test, y_test = make(4000, g)
                    sae = models(width, seed)[name]()
                    for chunk in x.split(2000):
                        sae.update(chunk)
                    sae.flush()
                    scores.append(float(best_latent_f1(sae.encode(x_test), y_test).mean()))
                cells.append(sum(scores) / len(scores))
            rows.append((width, name, cells[0], cells[1]))
            print(f"  [{clock}] width {width} {name}: linear {cells[0]:.3f}, nonlinear {cells[1]:.3f}", flush=True)
    report(f"best-latent F1 (seed 0, {tokens} training rows)", rows, ("width", "SAE", "linear", "nonlinear"))
    report("best-latent F1, 8 rays x 3 magnitudes, defaults", rays_at_defaults(clock), ("seed", "SAE", "F1"))
    print(f"\ntotal {clock}")


if __name__ == "__main__":
    main()
