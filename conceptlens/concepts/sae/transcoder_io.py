"""Exchange transcoders with SAELens (its "transcoder" / "skip_transcoder" layouts) and rebuild them.

    export_transcoder(tc, "out/tc")               # cfg.json + sae_weights.safetensors
    cs = import_transcoder("out/tc")              # a ConceptSet (directions: decoder rows at the output)
    tc = transcoder_from_concept_set(cs)          # encode / reconstruct with it, or train it further

SAELens 6 layout: W_enc (d_in, d_sae), b_enc (d_sae,), W_dec (d_sae, d_out), b_dec (d_out,),
W_skip (d_out, d_in) for "skip_transcoder" (ours is stored transposed, (d_in, d_out));
`apply_b_dec_to_input` is false (b_dec has the output's width) and activations are not normalised
(our scales are folded into the weights).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from safetensors.torch import load_file, save_file

from conceptlens._io import atomic_write
from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.concepts.registry import METHODS, names, saelens_architectures
from conceptlens.concepts.sae.saelens import CFG_FILE, LAYOUT_VERSION, WEIGHTS_FILE, hook_name
from conceptlens.concepts.sae.transcoder import SkipTranscoder, Transcoder

ARCHITECTURE = saelens_architectures(rows="pair")
CLASSES: dict[str, type[Transcoder]] = {name: METHODS[name].load() for name in ARCHITECTURE}


def export_transcoder(tc: Transcoder | ConceptSet, directory: str | os.PathLike) -> Path:
    """Write a transcoder (or its ConceptSet) in SAELens's layout into `directory`; returns the folder."""
    cs = tc.concept_set() if isinstance(tc, Transcoder) else tc
    if cs.method not in ARCHITECTURE:
        raise ValueError(f"not a transcoder set: method {cs.method!r}; expected one of {sorted(ARCHITECTURE)}")
    enc = cs.encoder
    width, d_out = cs.directions.shape
    tensors = {"W_enc": enc["W_enc"], "b_enc": enc["b_enc"], "W_dec": cs.directions, "b_dec": enc["b_dec"]}
    if "W_skip" in enc:
        tensors["W_skip"] = enc["W_skip"].T
    fit = got if isinstance(got := cs.config.get("fit"), dict) else {}
    # a fitted set is labelled with its target site, where its directions live; older sets with the source
    target = fit.get("target_site")
    source = fit.get("source_site", cs.site if target != cs.site else None)
    cfg: dict[str, Any] = {
        "d_in": int(enc["W_enc"].shape[0]), "d_sae": width, "d_out": d_out, "dtype": "float32", "device": "cpu",
        "apply_b_dec_to_input": False, "normalize_activations": "none", "reshape_activations": "none",
        "architecture": ARCHITECTURE[cs.method],
        "metadata": {"sae_lens_version": LAYOUT_VERSION, "sae_lens_training_version": LAYOUT_VERSION,
                     "model_name": cs.model, "hook_name": hook_name(source), "hook_name_out": hook_name(target),
                     "conceptlens_site": cs.site, "conceptlens_method": cs.method, "conceptlens_config": cs.config},
    }
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().contiguous() for k, v in tensors.items()}
    atomic_write(directory / WEIGHTS_FILE, lambda p: save_file(tensors, p))
    text = json.dumps(cfg, indent=2, default=str)
    atomic_write(directory / CFG_FILE, lambda p: Path(p).write_text(text))
    return directory


def import_transcoder(directory: str | os.PathLike) -> ConceptSet:
    """Read a SAELens "transcoder" or "skip_transcoder" folder as a ConceptSet in raw units."""
    directory = Path(directory)
    for name in (CFG_FILE, WEIGHTS_FILE):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / name} not found: a SAELens folder holds {CFG_FILE} and {WEIGHTS_FILE}")
    cfg = json.loads((directory / CFG_FILE).read_text())
    arch = cfg.get("architecture")
    if arch not in ARCHITECTURE.values():
        raise ValueError(f"architecture {arch!r} is not a transcoder; supported: {sorted(ARCHITECTURE.values())}")
    if cfg.get("normalize_activations", "none") not in ("none", None, False):
        raise ValueError(f"normalize_activations={cfg['normalize_activations']!r} is not supported; fold it first")
    w = {k: v.float() for k, v in load_file(directory / WEIGHTS_FILE).items()}
    d_in, width, d_out = cfg["d_in"], cfg["d_sae"], cfg["d_out"]
    expected = {"W_enc": (d_in, width), "b_enc": (width,), "W_dec": (width, d_out), "b_dec": (d_out,)}
    if arch == "skip_transcoder":
        expected["W_skip"] = (d_out, d_in)
    for key, shape in expected.items():
        if key not in w or tuple(w[key].shape) != shape:
            got = tuple(w[key].shape) if key in w else None
            raise ValueError(f"{directory / WEIGHTS_FILE}: {key} has shape {got}; {CFG_FILE} implies {shape}")
    encoder = {k: w[k] for k in ("W_enc", "b_enc", "b_dec")}
    if arch == "skip_transcoder":
        encoder["W_skip"] = w["W_skip"].T.contiguous()
    meta = cfg.get("metadata") or {}
    config = {"width": width, "d_in": d_in, "source": "saelens", "hook_name": meta.get("hook_name"),
              "hook_name_out": meta.get("hook_name_out")}
    return ConceptSet(w["W_dec"], meta.get("conceptlens_site"), method=names(saelens=arch)[0], config=config,
                      model=meta.get("model_name"), encoder=encoder)


def transcoder_from_concept_set(cs: ConceptSet) -> Transcoder:
    """The transcoder whose `encode` / `reconstruct` reproduce `cs` (scales 1, no optimiser state)."""
    cls = CLASSES.get(cs.method)
    if cls is None:
        raise ValueError(f"ConceptSet method {cs.method!r} is not a transcoder; expected one of {sorted(CLASSES)}")
    names = set(cls.Config.__dataclass_fields__)
    tc = cls(seed=cs.config.get("seed", 0), **{k: v for k, v in cs.config.items() if k in names})
    params: dict[str, Tensor] = {k: cs.encoder[k] for k in ("W_enc", "b_enc", "b_dec", "W_skip") if k in cs.encoder}
    tc.d_in = d_in = int(cs.encoder["W_enc"].shape[0])
    tc.adopt_raw({**params, "W_dec": cs.directions}, {"scale_in": torch.ones(()), "scale_out": torch.ones(())},
                 d_in + cs.d)
    return tc
