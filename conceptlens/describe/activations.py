"""What a concept's activation is, for each kind of ConceptSet: the one definition that the
description pass, the atlas, `conceptlens eval`'s probes and the steering samples share.

    act = concept_activations(cs)
    z = act.encode(x)                 # (N, d) -> (N, n)
    counts = act.fire_count(z, x)     # (n,) tokens with activation > 0
    assigned = act.assign_count(z, x) # (n,) tokens assigned to each concept (dense sets)

SAE sets use their own encoder: the latent activation (> 0 fires). Every other set (k-means,
Deleuzian, VQ, a probe, random directions, any direction) is scored by the cosine between the
token and the concept's centred direction, both measured from the fit's mean activation m:
cos(x - m, c'), c' = `cs.centred()` (c - m for centroids and codes; c without its component
along m for difference directions), or the raw x and c when the set carries no mean. The
projection x . c/|c| grows with the token's norm: on SmolLM2 one " ick" token at 2.5x the median
norm headed 120 of 128 k-means concepts; a cosine is bounded, so a token tops a concept only
by pointing its way. A dense concept is "active" on a token when its cosine is > 0 (the token
lies on the concept's side of the mean), the same threshold the histogram shows; the share of
tokens *assigned* to it (nearest centre for k-means / VQ / CLVQ, largest cosine otherwise)
is recorded apart. Pure tensor math, on the rows' own device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.concepts.registry import names

NEAREST = names(concepts="points")


@dataclass
class ConceptActivations:
    kind: str
    """How activations are computed, in words (recorded in description.json, shown on the atlas)."""
    sparse: bool
    """True for SAE sets: activations are mostly zero and `> 0` means firing."""
    encode_fn: Callable[[Tensor], Tensor]
    directions: Tensor
    """`(n, d)` unit directions the activations are measured along (centred when the set carries
    a mean): the atlas's neighbours, map and promoted tokens use these too."""
    assign_fn: Callable[[Tensor, Tensor], Tensor] | None = None
    """(z, x) -> (N,) index of the concept each token is assigned to (dense sets)."""

    def encode(self, x: Tensor) -> Tensor:
        return self.encode_fn(x.float())

    def fire_count(self, z: Tensor, x: Tensor) -> Tensor:
        """`(n,)` int64: rows where each concept is active (activation > 0), for every kind of set."""
        return torch.count_nonzero(z > 0, dim=0)

    def assign_count(self, z: Tensor, x: Tensor) -> Tensor | None:
        """`(n,)` int64: rows assigned to each concept (dense sets), else None."""
        if self.assign_fn is None:
            return None
        assigned = self.assign_fn(z, x)
        return torch.zeros(z.shape[1], dtype=torch.long, device=z.device).index_add_(
            0, assigned, torch.ones_like(assigned))


def concept_activations(cs: ConceptSet) -> ConceptActivations:
    """The activations of `cs`'s concepts; see the module docstring."""
    from conceptlens.concepts.sae.restore import CLASSES, sae_from_concept_set

    if cs.method in CLASSES:
        sae = sae_from_concept_set(cs)
        return ConceptActivations(f"{cs.method} encoder", True, lambda x: _on(sae, x).encode(x),
                                  torch.nn.functional.normalize(cs.directions.float(), dim=1))
    centred = cs.mean is not None
    unit = torch.nn.functional.normalize((cs.centred() if centred else cs).directions.float(), dim=1)
    mean = cs.mean.float() if cs.mean is not None else torch.zeros(cs.d)
    raw = cs.directions.float()  # the centres: a set given as `cs.centred()` holds c - mean
    if cs.config.get("centred") and cs.mean is not None and cs.method in NEAREST:
        raw = raw + cs.mean.float()
    cache: dict[torch.device, tuple[Tensor, Tensor, Tensor, Tensor]] = {}

    def moved(device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if device not in cache:
            c = raw.to(device)
            cache[device] = (unit.to(device), mean.to(device), c, c.pow(2).sum(1))
        return cache[device]

    def encode(x: Tensor) -> Tensor:  # (N, d) -> (N, n) cosines
        u, m, _, _ = moved(x.device)
        xc = x - m
        return (xc @ u.T) / torch.linalg.vector_norm(xc, dim=1, keepdim=True).clamp_min(1e-30)

    if cs.method in NEAREST and not cs.config.get("spherical", False):
        def assign(z: Tensor, x: Tensor) -> Tensor:  # argmin |x - c|^2 = argmax 2 x.c - |c|^2
            _, _, c, c2 = moved(x.device)
            return (2 * x @ c.T - c2).argmax(1)
        rule = "assigned: nearest centre"
    else:
        def assign(z: Tensor, x: Tensor) -> Tensor:
            return z.argmax(1)
        rule = "assigned: largest cosine"
    origin = "centred on the fit's mean" if centred else "uncentred (the set carries no mean)"
    fitted = "; fitted on document means" if cs.config.get("unit") == "document" else ""
    return ConceptActivations(f"cosine to the concept direction, {origin}; active: cosine > 0; {rule}{fitted}",
                              False, encode, unit, assign)


def _on(sae, x: Tensor):
    """The restored SAE on x's device (moved once; it lives only inside this pass)."""
    return sae if next(sae.parameters()).device == x.device else sae.to(x.device)
