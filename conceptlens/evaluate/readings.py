"""How the probes read a set's concepts, and its matched random control read the same way.

    readers = probe_readers(sets, ("activation", "code"), draws=5, seed=0)   # column -> (N, d) -> (N, n)
    probed = collect(lens, site, readers, batches)                           # evaluate.activations
    z = probed.z[column("topk", "code")]; control = probed.z[column("topk", "code", draw=0)]

Two readings (`READINGS`), each a reader for the set and one for its control of as many random
unit directions of the site as the set has concepts (`random_directions`, seeds seed + 1
+ draw), applied to every token before a document's tokens are mean-pooled:
- "activation": the suite's definition (`activations.concept_encoder`: an SAE's code, a VQ
  codebook's one-hot code, the cosine to the centred direction for dense sets); the control by
  the cosine to the random directions centred on the set's mean, or by the projection when the
  set carries no mean (SAEs).
- "code": every set by its nonlinear code, the control through the same nonlinearity: an SAE's
  code (SAEBench's reading: mean-pooled latent activations) against a random encoder of the same
  width, k and decoder bias (TopK: `topk_relu((x - b_dec) @ R.T, k)`; an SAE without k, such as
  JumpReLU, against a plain ReLU of that: no threshold, so its control is denser than its code), a dense
  set's assigned concept (one-hot; nearest centre for k-means, largest cosine otherwise,
  `describe.activations`) against the one-hot random direction of largest cosine.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from conceptlens.concepts.conceptset import ConceptSet

READINGS = ("activation", "code")

READ_NOTE = {"activation": "concepts read by their activations (an SAE's code, a dense concept's cosine), "
                           "random directions by projection or cosine",
             "code": "concepts read by their codes (an SAE's TopK code, a dense set's assigned concept), random "
                     "directions through the same nonlinearity (a random TopK encoder, the largest cosine)"}

Reader = Callable[[Tensor], Tensor]
"""`(N, d)` site activations -> `(N, n)` what the probe reads"""


def check_reading(reading: str) -> None:
    if reading not in READINGS:
        raise ValueError(f"unknown probe reading {reading!r}; choose one of {', '.join(READINGS)}")


def random_directions(n: int, d: int, seed: int) -> Tensor:
    """`(n, d)` unit directions drawn uniformly on the sphere."""
    return F.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=1)


def column(name: str, reading: str = "activation", draw: int | None = None) -> str:
    """The `Probed.z` key of set `name` read by `reading`, or of its control's `draw` (set names are
    folder names, so they hold no '/'); the activation reading of a set is its plain name."""
    key = name if reading == "activation" else f"{name}/{reading}"
    return key if draw is None else f"{key}/random {draw}"


def set_reader(cs: ConceptSet, reading: str = "activation") -> Reader:
    """`cs`'s concepts as the probe reads them (see the module docstring)."""
    from conceptlens.concepts.sae.restore import CLASSES
    from conceptlens.describe.activations import concept_activations
    from conceptlens.evaluate.activations import concept_encoder

    check_reading(reading)
    if reading == "activation" or cs.method in CLASSES:
        return concept_encoder(cs).encode
    act = concept_activations(cs)
    assign = act.assign_fn
    if assign is None:
        raise ValueError(f"a {cs.method!r} set assigns no concept to a token; read it with reading='activation'")
    return lambda x: F.one_hot(assign(act.encode(x.float()), x.float()), len(cs)).float()


def control_reader(cs: ConceptSet, seed: int, reading: str = "activation") -> Reader:
    """`len(cs)` random unit directions of the site (seeded), read as `cs`'s concepts are."""
    from conceptlens.concepts.sae.restore import CLASSES
    from conceptlens.concepts.sae.topk import topk_relu
    from conceptlens.evaluate.activations import concept_encoder

    check_reading(reading)
    n = len(cs)
    directions = random_directions(n, cs.d, seed)
    if reading == "code" and cs.method in CLASSES:
        b_dec = cs.encoder["b_dec"].float()
        k = cs.config.get("k")
        if k is None:
            return lambda x: torch.relu((x.float() - b_dec) @ directions.T)
        return lambda x: topk_relu((x.float() - b_dec) @ directions.T, min(int(k), n))
    if cs.mean is None:
        linear: Reader = lambda x: x.float() @ directions.T
    else:
        randoms = ConceptSet(directions, cs.site, method="random", mean=cs.mean, config={"centred": True})
        linear = concept_encoder(randoms).encode
    if reading == "code":
        return lambda x: F.one_hot(linear(x).argmax(1), n).float()
    return linear


def probe_readers(sets: Mapping[str, ConceptSet], readings: Sequence[str] = READINGS, *, draws: int,
                  seed: int = 0) -> dict[str, Reader]:
    """column -> reader: every set by every reading and its control's `draws` (seeds seed + 1 + draw).
    An SAE's code is its activation: its code column reads the activation once more (cheap beside
    its controls), so that every reading has all its columns."""
    out: dict[str, Reader] = {}
    slashed = [name for name in sets if "/" in name]
    if slashed:
        raise ValueError(f"set name {slashed[0]!r} holds a '/', which separates a set's columns; rename it")
    for reading in readings:
        check_reading(reading)
        for name, cs in sets.items():
            out[column(name, reading)] = set_reader(cs, reading)
            for r in range(draws):
                out[column(name, reading, r)] = control_reader(cs, seed + 1 + r, reading)
    return out


__all__ = ["READINGS", "READ_NOTE", "Reader", "check_reading", "column", "control_reader", "probe_readers",
           "random_directions", "set_reader"]
