"""Rebuild a crosscoder or cross-layer transcoder from its ConceptSet (our own format: SAELens
6.54 has no crosscoder or CLT class; it reads a Gemma Scope 2 CLT layer only as a transcoder
whose decoders are summed over the targets, which cannot reconstruct).

    cs.save("run/clt"); cs = ConceptSet.load("run/clt")
    clt = multisite_from_concept_set(cs)       # encode / reconstruct exactly as the fitted one

The set holds raw-space weights, so the rebuilt object has every site scale 1 and no optimiser
state; a further `update` starts a fresh Adam.
"""

from __future__ import annotations

import dataclasses

import torch

from conceptlens._content import check_concept_tensors
from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.concepts.registry import METHODS, names
from conceptlens.concepts.sae.clt import CrossLayerTranscoder
from conceptlens.concepts.sae.crosscoder import Crosscoder, ReLUCrosscoder

CLASSES: dict[str, type[Crosscoder | ReLUCrosscoder | CrossLayerTranscoder]] = {
    name: METHODS[name].load() for name in (*names(rows="sites"), *names(rows="groups"))}


def multisite_from_concept_set(cs: ConceptSet) -> Crosscoder | ReLUCrosscoder | CrossLayerTranscoder:
    """The crosscoder or cross-layer transcoder whose `encode` / `reconstruct` reproduce `cs`."""
    cls = CLASSES.get(cs.method)
    if cls is None:
        raise ValueError(f"ConceptSet method {cs.method!r} is not a multi-site set; expected one of {sorted(CLASSES)}")
    missing = [k for k in ("W_enc", "b_enc", "b_dec") if k not in cs.encoder]
    if missing or not cs.config.get("widths"):
        raise ValueError(f"{cs!r} lacks {missing or ['config.widths']}; a {cs.method} set holds its encoder and widths")
    check_concept_tensors(repr(cs), "the set", cs.directions, cs.encoder, cs.mean)
    names = {f.name for f in dataclasses.fields(cls.Config)}
    model = cls(seed=cs.config.get("seed", 0), **{k: v for k, v in cs.config.items() if k in names})
    widths = list(cs.config["widths"])
    if cls is CrossLayerTranscoder:
        layers, d_in = cs.encoder["W_enc"].shape[:2]
        model.widths, model.shape = [int(d_in)] * layers + widths, [layers, layers]
    else:
        model.widths, model.shape = widths, [1] * len(widths)
    params = {k: cs.encoder[k] for k in ("W_enc", "b_enc", "b_dec")}
    model.adopt_raw({**params, "W_dec": cs.directions}, {"site_scale": torch.ones(len(model.widths))},
                    sum(model.widths))
    return model
