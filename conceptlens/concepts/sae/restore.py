"""Rebuild an SAE object from a ConceptSet, to encode with it (or to train it further).

    sae = sae_from_concept_set(cs)            # cs from sae.concept_set() or import_saelens(...)
    z = sae.encode(x)                         # (N, d) raw activations -> (N, width)

The ConceptSet holds raw-space weights, so the rebuilt SAE has input scale 1 and no
optimiser state; a further `update` starts a fresh Adam.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor

from conceptlens._content import check_concept_tensors, field
from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.concepts.registry import METHODS, names
from conceptlens.concepts.sae.base import SparseAutoencoder
from conceptlens.concepts.sae.batchtopk import BatchTopKSAE
from conceptlens.concepts.sae.jumprelu import JumpReLUSAE
from conceptlens.concepts.sae.hsae import HSAE
from conceptlens.concepts.sae.mpsae import MPSAE
from conceptlens.concepts.sae.spade import SpaDE

CLASSES: dict[str, type[SparseAutoencoder]] = {name: METHODS[name].load()
                                                for name in names(rows="site", concepts="decoder")}
"""The SAE classes a one-site set rebuilds into, by method."""


def sae_from_concept_set(cs: ConceptSet) -> SparseAutoencoder:
    """The SAE whose `encode` / `decode` / `concept_set` reproduce `cs` (method must be an SAE's)."""
    cls = CLASSES.get(cs.method)
    if cls is None:
        raise ValueError(f"ConceptSet method {cs.method!r} is not an SAE; expected one of {sorted(CLASSES)}")
    _check_content(cs)
    names = {f.name for f in dataclasses.fields(cls.Config)}
    kwargs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in cs.config.items() if k in names}
    sae = cls(seed=cs.config.get("seed", 0), **kwargs)
    raw = {**cs.encoder, "W_dec": cs.directions}
    params: dict[str, Tensor] = {k: raw[k].clone() for k in ("W_enc", "b_enc", "W_dec", "b_dec") if k in raw}
    if cls is JumpReLUSAE:
        params["log_threshold"] = raw["threshold"].log()
    elif cls is BatchTopKSAE:
        sae.buffer_dict = {"threshold": raw["threshold"].clone().reshape(()),
                       "threshold_steps": torch.ones((), dtype=torch.int64)}
    elif cls is SpaDE:
        lam = float(raw["lambda"])
        mean = raw.get("input_mean", torch.zeros(cs.d)).float()  # (sets saved before standardisation)
        std = raw.get("input_std", torch.ones(cs.d)).float()
        params = {"prototypes": (raw["prototypes"] - mean) / std, "W_dec": raw["W_dec"] / std,
                  "lambda_pre": torch.tensor(math.log(math.expm1(lam)))}
        sae.buffer_dict = {"input_mean": mean.clone(), "input_std": std.clone()}
    elif cls is HSAE:
        params = {k: raw[k].clone() for k in ("W_enc", "W_top", "W_down", "W_up", "E_child", "D_child", "b_dec")}
        sae.buffer_dict = {"offset": raw["offset"].clone().reshape(())}
    sae.adopt_raw(params, dict(sae.buffer_dict), cs.d)
    return sae


NEEDS = {MPSAE.method: ("b_dec",), JumpReLUSAE.method: ("threshold",), BatchTopKSAE.method: ("threshold",),
         SpaDE.method: ("prototypes", "lambda"),
         HSAE.method: ("W_enc", "W_top", "W_down", "W_up", "E_child", "D_child", "b_dec", "offset")}


def _check_content(cs: ConceptSet) -> None:
    """The set holds a whole SAE: its encoder tensors, finite, and a width that is its number of concepts."""
    where = f"{cs!r}"
    if "parent_indices" in cs.config:
        raise ValueError(f"{where} is a subset of an SAE's concepts; rebuild the SAE from the whole set")
    field(where, "config.width", cs.config.get("width"), int, low=len(cs), high=len(cs))
    needed = NEEDS.get(cs.method, ("W_enc", "b_enc", "b_dec"))
    missing = [k for k in needed if k not in cs.encoder]
    if missing:
        raise ValueError(f"{where} lacks the encoder tensors {missing}; an SAE set holds {list(needed)}")
    check_concept_tensors(where, "the set", cs.directions, cs.encoder, cs.mean)
