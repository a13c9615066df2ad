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
from safetensors.torch import save_file

from conceptlens._content import MAX_COUNT, check_tensor, field, read_json
from conceptlens._io import atomic_write, read_safetensors
from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.concepts.registry import names, saelens_architectures
from conceptlens.concepts.sae.base import SparseAutoencoder

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
# SAELens reads a config as its 6.x layout when metadata.sae_lens_version is >= 6.0
# (older ones are renamed field by field); this names the layout, not a dependency.
LAYOUT_VERSION = "6.0.0"

# method -> SAELens architecture, and back (an architecture reads as the first method declaring it)
ARCHITECTURE = saelens_architectures(rows="site")
METHOD = {arch: next(iter(names(saelens=arch))) for arch in ("standard", "topk", "jumprelu")}
# our site names -> the TransformerLens hook names SAELens configs use, where the two hold the same
# tensor (checked against TransformerLens's own cache in the tests). Not here: TransformerLens's
# `hook_embed` (the token embedding alone: before GPT-2's position embedding) and its
# `ln*.hook_normalized` (before the norm's weight and bias), which are not our `embed`, `mlp.in`, `final`.
HOOKS = {"resid_in": "hook_resid_pre", "resid_out": "hook_resid_post", "attn_out": "hook_attn_out",
         "mlp_out": "hook_mlp_out"}


def hook_name(site: str | None) -> str | None:
    """`blocks.5.resid_out` -> `blocks.5.hook_resid_post`, `embed` -> `blocks.0.hook_resid_pre`; names
    without a TransformerLens twin are kept as they are."""
    if site == "embed":
        return "blocks.0.hook_resid_pre"
    match = re.fullmatch(r"blocks\.(-?\d+)\.([\w.]+)", site or "")
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
                     "model_name": _export_model_id(cs.model), "hook_name": hook_name(cs.site),
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


def import_saelens(directory: str | os.PathLike, *, centre: bool | None = None) -> ConceptSet:
    """Read a SAELens folder (standard, topk or jumprelu) as a ConceptSet in raw activation units.

    Layouts that differ from ours only by a reparametrisation are folded exactly:
    `apply_b_dec_to_input=False` (Gemma Scope: b_enc += b_dec W_enc),
    `rescale_acts_by_decoder_norm=True` (SAELens's TopK training default: decoder rows to
    unit norm, their norms into W_enc and b_enc, as SAELens's own `fold_W_dec_norm`), and
    JumpReLU thresholds <= 0 (SAELens computes ReLU(pre) * [pre > theta], which equals
    threshold 0 there). `centre=True` (default: when `model_from_pretrained_kwargs` says
    `center_writing_weights`, i.e. TransformerLens-processed activations) folds the
    per-token centring x - mean_d(x) into the encoder, so `encode` takes our raw `resid_out`
    rows; the decoder then reconstructs the centred activation. The hook name becomes our
    site name (`blocks.1.hook_resid_post` -> `blocks.1.resid_out`) and is kept in the config; a
    hook no site of ours equals (`hook_embed`, `ln2.hook_normalized`, ...) stays the set's site, which
    a lens refuses: set `cs.site` where the two coincide for your model. A config from before
    SAELens 6 (`hook_point`, `activation_fn_str`) is read as SAELens reads it.
    """
    directory = Path(directory)
    for name in (CFG_FILE, WEIGHTS_FILE):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / name} not found: "
                                    f"a SAELens folder holds {CFG_FILE} and {WEIGHTS_FILE}")
    cfg = _checked_cfg(directory / CFG_FILE)
    arch = cfg.get("architecture", "standard")
    if arch not in METHOD:
        raise ValueError(f"architecture {arch!r} is not supported; supported: {sorted(METHOD)}")
    for key, ok in (("normalize_activations", ("none", False, None)), ("reshape_activations", ("none", None))):
        if cfg.get(key, "none") not in ok:
            raise ValueError(f"{key}={cfg[key]!r} is not supported (it is not a fixed linear map); "
                             "fold it into the weights first")
    w = _checked_weights(directory, cfg, arch)
    meta = cfg.get("metadata") or {}
    folded: list[str] = []
    if not cfg.get("apply_b_dec_to_input", True):
        w["b_enc"] = w["b_enc"] + w["b_dec"] @ w["W_enc"]
        folded.append("apply_b_dec_to_input")
    if arch == "topk" and cfg.get("rescale_acts_by_decoder_norm"):
        norms = w["W_dec"].norm(dim=-1).clamp(min=1e-8)  # (d_sae,)
        w["W_dec"], w["W_enc"], w["b_enc"] = w["W_dec"] / norms[:, None], w["W_enc"] * norms, w["b_enc"] * norms
        folded.append("rescale_acts_by_decoder_norm")
    if arch == "jumprelu" and (w["threshold"] <= 0).any():
        w["threshold"] = w["threshold"].clamp(min=0.0)
        folded.append("non_positive_thresholds")
    tl_kwargs = meta.get("model_from_pretrained_kwargs") or cfg.get("model_from_pretrained_kwargs") or {}
    if centre is None:
        centre = bool(tl_kwargs.get("center_writing_weights"))
    if centre:
        _fold_centring(w)
        folded.append("centre_per_token")
    hook = meta.get("hook_name") or cfg.get("hook_name")
    config: dict[str, Any] = {"width": cfg["d_sae"], "source": "saelens", "hook_name": hook, "folded": folded,
                              "input_centred_per_token": bool(centre), "tl_processing": tl_kwargs}
    if arch == "topk":
        config["k"] = cfg["k"]
    expected_keys = ("W_enc", "b_enc", "b_dec", "threshold") if arch == "jumprelu" else ("W_enc", "b_enc", "b_dec")
    encoder = {k: w[k] for k in expected_keys}
    site = meta.get("conceptlens_site") or site_from_hook_name(hook)
    return ConceptSet(w["W_dec"], site, method=METHOD[arch], config=config,
                      model=_model_id(meta.get("model_name") or cfg.get("model_name")), encoder=encoder)


def _checked_cfg(path: Path) -> dict[str, Any]:
    """cfg.json with the JSON types and ranges of the fields this reader uses, a config from before
    SAELens 6 read in 6's terms (`_before_6`)."""
    cfg = _before_6(path, field(path, "the file", read_json(path), dict))
    d_sae = field(path, "d_sae", cfg.get("d_sae"), int, low=1, high=MAX_COUNT)
    field(path, "d_in", cfg.get("d_in"), int, low=1, high=MAX_COUNT)
    if cfg.get("architecture") == "topk":
        field(path, "k", cfg.get("k"), int, low=1, high=d_sae)
    field(path, "architecture", cfg.get("architecture"), str, optional=True)
    for key in ("apply_b_dec_to_input", "rescale_acts_by_decoder_norm"):
        field(path, key, cfg.get(key), bool, optional=True)
    meta = field(path, "metadata", cfg.get("metadata"), dict, optional=True) or {}
    for where, block in (("", cfg), ("metadata.", meta)):
        field(path, f"{where}model_from_pretrained_kwargs", block.get("model_from_pretrained_kwargs"), dict,
              optional=True)
        for key in ("hook_name", "model_name", "conceptlens_site"):
            field(path, f"{where}{key}", block.get(key), str, optional=True)
    return cfg


def _before_6(path: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """A config written before SAELens 6 (its `sae_lens_version`, top-level or in `metadata`, below 6 or
    absent, as SAELens decides) in 6's terms, as SAELens itself reads one: `hook_point` is the hook
    name, no architecture is "standard", and an `activation_fn(_str)` "topk" with a k in
    `activation_fn_kwargs` is a TopK SAE of that k (whatever `architecture` says); another activation
    than ReLU of a "standard" SAE is refused."""
    meta = cfg.get("metadata")
    version = str((meta.get("sae_lens_version") if isinstance(meta, dict) else None) or cfg.get("sae_lens_version")
                  or "0")
    major = re.match(r"\d+", version)
    if major is not None and int(major.group()) >= 6:
        return cfg
    cfg = dict(cfg)
    if "hook_point" in cfg and "hook_name" not in cfg:
        cfg["hook_name"] = cfg["hook_point"]
    activation = cfg.get("activation_fn", cfg.get("activation_fn_str", "relu"))
    kwargs = cfg.get("activation_fn_kwargs") or {}
    cfg.setdefault("architecture", "standard")
    if activation == "topk" and isinstance(kwargs, dict) and kwargs.get("k") is not None:
        cfg["architecture"], cfg["k"] = "topk", kwargs["k"]
    elif activation == "relu" or cfg["architecture"] != "standard":
        pass  # a jumprelu or topk SAE names its activation by its architecture
    else:
        raise ValueError(f"{path}: activation {activation!r} (a config from before SAELens 6) is not supported; "
                         "supported: relu, topk with activation_fn_kwargs.k")
    return cfg


def _checked_weights(directory: Path, cfg: dict[str, Any], arch: str) -> dict[str, torch.Tensor]:
    w = {k: v.float() for k, v in read_safetensors(directory / WEIGHTS_FILE)[0].items()}
    expected = {"W_enc": (cfg["d_in"], cfg["d_sae"]), "b_enc": (cfg["d_sae"],),
                "W_dec": (cfg["d_sae"], cfg["d_in"]), "b_dec": (cfg["d_in"],)}
    if arch == "jumprelu":
        expected["threshold"] = (cfg["d_sae"],)
    for key, shape in expected.items():
        if key not in w or tuple(w[key].shape) != shape:
            got = tuple(w[key].shape) if key in w else None
            raise ValueError(f"{directory / WEIGHTS_FILE}: {key} has shape {got}; {CFG_FILE} implies {shape}")
        check_tensor(directory / WEIGHTS_FILE, key, w[key])
    return w


def _fold_centring(w: dict[str, torch.Tensor]) -> None:
    """(P x - b) W + c with P = I - 11^T/d  ==  (x - b) (P W) + c - mean(b) 1^T W: exact and linear."""
    column_means = w["W_enc"].mean(0, keepdim=True)  # (1, d_sae)
    w["b_enc"] = w["b_enc"] - w["b_dec"].sum() * column_means[0]
    w["W_enc"] = w["W_enc"] - column_means


_TL_SITE = {v: k for k, v in HOOKS.items()} | {"attn.hook_z": "attn.z", "mlp.hook_post": "mlp.post",
                                                "attn.hook_q": "attn.q", "attn.hook_k": "attn.k",
                                                "attn.hook_v": "attn.v", "attn.hook_pattern": "attn.pattern"}
_HF_MODULE = re.compile(r"(?:model\.|transformer\.|gpt_neox\.|base_model\.|bert\.|roberta\.|encoder\.)*(?:layers|h|layer|blocks)\.(-?\d+)"
                        r"(?:\.(self_attn|attn|attention|mlp))?")
_HF_SUFFIX = {None: "resid_out", "self_attn": "attn_out", "attn": "attn_out", "attention": "attn_out",
              "mlp": "mlp_out"}


def site_from_hook_name(hook: str | None) -> str | None:
    """A TransformerLens hook name or an HF module path -> our site name (unknown names are kept).

    `blocks.5.hook_resid_post` -> `blocks.5.resid_out`; `blocks.5.attn.hook_z` -> `blocks.5.attn.z`;
    `model.layers.5` (a decoder layer's output) -> `blocks.5.resid_out`; `model.layers.5.mlp` -> `mlp_out`.
    """
    if not hook:
        return hook
    if hook == "model.norm":  # the HF module's output: after its weight, as our `final`
        return "final"
    match = re.fullmatch(r"blocks\.(-?\d+)\.(.+)", hook)
    if match and match.group(2) in _TL_SITE:
        return f"blocks.{match.group(1)}.{_TL_SITE[match.group(2)]}"
    match = _HF_MODULE.fullmatch(hook)
    if match:
        return f"blocks.{match.group(1)}.{_HF_SUFFIX[match.group(2)]}"
    return hook


def _model_id(name: str | None) -> str | None:
    """A hub id of a registered model -> its registered name (so it matches the lens); others unchanged."""
    from conceptlens.models import REGISTRY

    for registered, entry in REGISTRY.items():
        if name and name == entry.hub_id:
            return registered
    return name


def _export_model_id(name: str | None) -> str | None:
    from conceptlens.models import REGISTRY

    entry = REGISTRY.get(name or "")
    return entry.hub_id if entry is not None and entry.hub_id else name
