"""Exchange SAEs with SAELens: its on-disk layout, `cfg.json` + `sae_weights.safetensors`.

    export_saelens(sae, "out/sae")             # or a ConceptSet from sae.concept_set()
    cs = import_saelens("out/sae")             # a ConceptSet; sae_from_concept_set(cs) encodes

The layout is SAELens 6's (`SAE.save_model` / `SAE.load_from_disk`): W_enc (d_in, d_sae),
b_enc (d_sae,), W_dec (d_sae, d_in), b_dec (d_in,), and threshold (d_sae,) for "jumprelu".
Weights are raw-space (our input scale is already folded in), so `normalize_activations` is
"none". ReLU SAEs map to "standard", TopK and Matryoshka to "topk", JumpReLU and BatchTopK
(its global threshold repeated per latent) to "jumprelu". SpaDE has no SAELens counterpart.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from conceptlens._io import atomic_write
from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.concepts.sae.base import SparseAutoencoder

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
# SAELens reads a config as its 6.x layout when metadata.sae_lens_version is >= 6.0
# (older ones are renamed field by field); this names the layout, not a dependency.
LAYOUT_VERSION = "6.0.0"

ARCHITECTURE = {"relu_sae": "standard", "topk_sae": "topk", "matryoshka_sae": "topk",
                "jumprelu_sae": "jumprelu", "batchtopk_sae": "jumprelu"}
METHOD = {"standard": "relu_sae", "topk": "topk_sae", "jumprelu": "jumprelu_sae"}
# our site names -> TransformerLens hook names, which SAELens configs use
HOOKS = {"resid_in": "hook_resid_pre", "resid_out": "hook_resid_post",
         "attn_out": "hook_attn_out", "mlp_out": "hook_mlp_out"}


def hook_name(site: str | None) -> str | None:
    """`blocks.5.resid_out` -> `blocks.5.hook_resid_post`; other names are kept as they are."""
    match = re.fullmatch(r"blocks\.(-?\d+)\.(\w+)", site or "")
    if match and match.group(2) in HOOKS:
        return f"blocks.{match.group(1)}.{HOOKS[match.group(2)]}"
    return site


def export_saelens(sae: SparseAutoencoder | ConceptSet, directory: str | os.PathLike) -> Path:
    """Write an SAE (or its ConceptSet) in SAELens's layout into `directory`; returns the folder."""
    cs = sae.concept_set() if isinstance(sae, SparseAutoencoder) else sae
    arch = ARCHITECTURE.get(cs.method)
    if arch is None:
        raise ValueError(f"SAELens has no layout for method {cs.method!r}; exportable: {sorted(ARCHITECTURE)}")
    enc = cs.encoder
    width, d = cs.directions.shape
    tensors = {"W_enc": enc["W_enc"], "b_enc": enc["b_enc"], "W_dec": cs.directions, "b_dec": enc["b_dec"]}
    cfg: dict[str, Any] = {
        "d_in": d, "d_sae": width, "dtype": "float32", "device": "cpu", "apply_b_dec_to_input": True,
        "normalize_activations": "none", "reshape_activations": "none", "architecture": arch,
        "metadata": {"sae_lens_version": LAYOUT_VERSION, "sae_lens_training_version": LAYOUT_VERSION,
                     "model_name": cs.model, "hook_name": hook_name(cs.site),
                     "conceptlens_site": cs.site, "conceptlens_method": cs.method, "conceptlens_config": cs.config},
    }
    if arch == "topk":
        cfg |= {"k": cs.config["k"], "rescale_acts_by_decoder_norm": False}
    if arch == "jumprelu":
        tensors["threshold"] = enc["threshold"].expand(width)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().contiguous() for k, v in tensors.items()}
    atomic_write(directory / WEIGHTS_FILE, lambda p: save_file(tensors, p))
    text = json.dumps(cfg, indent=2)
    atomic_write(directory / CFG_FILE, lambda p: Path(p).write_text(text))
    return directory


def import_saelens(directory: str | os.PathLike) -> ConceptSet:
    """Read a SAELens folder (standard, topk or jumprelu; unnormalised) as a ConceptSet."""
    directory = Path(directory)
    for name in (CFG_FILE, WEIGHTS_FILE):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / name} not found: "
                                    f"a SAELens folder holds {CFG_FILE} and {WEIGHTS_FILE}")
    cfg = json.loads((directory / CFG_FILE).read_text())
    arch = cfg.get("architecture", "standard")
    if arch not in METHOD:
        raise ValueError(f"architecture {arch!r} is not supported; supported: {sorted(METHOD)}")
    if cfg.get("normalize_activations", "none") not in ("none", False):
        raise ValueError(f"normalize_activations={cfg['normalize_activations']!r} is not supported; fold it first")
    if not cfg.get("apply_b_dec_to_input", True):
        raise ValueError("apply_b_dec_to_input=False is not supported: our encoders subtract b_dec first")
    if cfg.get("rescale_acts_by_decoder_norm"):
        raise ValueError("rescale_acts_by_decoder_norm=True is not supported; fold the decoder norms first")
    w = {k: v.float() for k, v in load_file(directory / WEIGHTS_FILE).items()}
    expected = {"W_enc": (cfg["d_in"], cfg["d_sae"]), "b_enc": (cfg["d_sae"],),
                "W_dec": (cfg["d_sae"], cfg["d_in"]), "b_dec": (cfg["d_in"],)}
    if arch == "jumprelu":
        expected["threshold"] = (cfg["d_sae"],)
    for key, shape in expected.items():
        if key not in w or tuple(w[key].shape) != shape:
            got = tuple(w[key].shape) if key in w else None
            raise ValueError(f"{directory / WEIGHTS_FILE}: {key} has shape {got}; {CFG_FILE} implies {shape}")
    meta = cfg.get("metadata") or {}
    config: dict[str, Any] = {"width": cfg["d_sae"], "source": "saelens"}
    if arch == "topk":
        config["k"] = cfg["k"]
    encoder = {k: w[k] for k in expected if k != "W_dec"}
    return ConceptSet(w["W_dec"], meta.get("conceptlens_site") or meta.get("hook_name"), method=METHOD[arch],
                      config=config, model=meta.get("model_name"), encoder=encoder)
