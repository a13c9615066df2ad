"""What a concept's activation is, for each kind of ConceptSet, on the rows' own device.

    act = concept_activations(cs)
    z = act.encode(x)                 # (N, d) -> (N, n)
    counts = act.fire_count(z, x)     # (n,) tokens on which each concept fires / that it is assigned

SAE sets use their own encoder (activation > 0 fires). Every other set (k-means, Deleuzian,
VQ, a probe, any direction) is scored by the projection on its unit directions x . c/|c|,
so top contexts are the tokens furthest along the direction; a token "fires" the concept it
is assigned to: the nearest centre for k-means / VQ / CLVQ codes (largest cosine for
spherical k-means), the largest projection otherwise. Pure tensor math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from conceptlens.concepts.conceptset import ConceptSet

NEAREST = ("kmeans", "vq", "clvq")


@dataclass
class ConceptActivations:
    kind: str
    """How activations are computed, in words (recorded in description.json)."""
    sparse: bool
    """True for SAE sets: activations are mostly zero and `> 0` means firing."""
    encode_fn: Callable[[Tensor], Tensor]
    assign_fn: Callable[[Tensor, Tensor], Tensor] | None = None
    """(z, x) -> (N,) index of the concept each token is assigned to (dense sets)."""

    def encode(self, x: Tensor) -> Tensor:
        return self.encode_fn(x.float())

    def fire_count(self, z: Tensor, x: Tensor) -> Tensor:
        """`(n,)` int64: rows where each concept fires (> 0), or is assigned (dense sets)."""
        if self.assign_fn is None:
            return torch.count_nonzero(z > 0, dim=0)
        assigned = self.assign_fn(z, x)
        return torch.zeros(z.shape[1], dtype=torch.long, device=z.device).index_add_(
            0, assigned, torch.ones_like(assigned))


def concept_activations(cs: ConceptSet) -> ConceptActivations:
    from conceptlens.concepts.sae.restore import CLASSES, sae_from_concept_set

    if cs.method in CLASSES:
        sae = sae_from_concept_set(cs)
        return ConceptActivations(f"{cs.method} encoder", True, lambda x: _on(sae, x).encode(x))
    directions = cs.directions.float()
    unit = torch.nn.functional.normalize(directions, dim=1)
    cache: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}

    def moved(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        if device not in cache:
            c = directions.to(device)
            cache[device] = (unit.to(device), c, c.pow(2).sum(1))
        return cache[device]

    def encode(x: Tensor) -> Tensor:
        return x @ moved(x.device)[0].T

    if cs.method in NEAREST and not cs.config.get("spherical", False):
        def assign(z: Tensor, x: Tensor) -> Tensor:  # argmin |x - c|^2 = argmax 2 x.c - |c|^2
            _, c, c2 = moved(x.device)
            return (2 * x @ c.T - c2).argmax(1)
        how = "projection on the unit directions; assigned to the nearest centre"
    else:
        def assign(z: Tensor, x: Tensor) -> Tensor:
            return z.argmax(1)
        how = "projection on the unit directions; assigned to the largest projection"
    return ConceptActivations(how, False, encode, assign)


def _on(sae, x: Tensor):
    """The restored SAE on x's device (moved once; it lives only inside this pass)."""
    if sae._device != x.device:
        sae.params = {k: v.detach().to(x.device) for k, v in sae.params.items()}
        if getattr(sae, "buffers", None):
            sae.buffers = {k: v.to(x.device) for k, v in sae.buffers.items()}
        sae._device = x.device
    return sae
