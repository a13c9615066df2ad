"""ConceptSet: concept directions in one site's activation space, saved without pickle.

    cs = ConceptSet(torch.randn(8, 576), site="blocks.5.resid_out", method="probe")
    cs.save("run/concepts")                    # concepts.safetensors + config.json (+ sha256)
    cs = ConceptSet.load("run/concepts")
    cs[3], cs[[3, 7]]                          # smaller ConceptSets
    cs.centred()                               # directions measured from the fit's mean activation
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import save_file
from torch import Tensor

from conceptlens._content import MAX_COUNT, check_concept_tensors, field, parse_json
from conceptlens._io import atomic_write, read_safetensors, remove_leftovers, tensor_digest
from conceptlens.concepts.registry import canonical, names

FORMAT = "conceptlens.ConceptSet"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1: no checksum, no config copy inside the tensor file
DIFFERENCE_METHODS = frozenset({*names(concepts="differences"), "random"})  # directions, not points near the mean
"""Methods whose directions are differences of activations, not points among them (see `centred`)."""
TENSOR_FILE = "concepts.safetensors"
CONFIG_FILE = "config.json"
K_PAST_WIDTH = frozenset(names(k_past_width=True))
"""Methods whose `k` (pursuit steps) may exceed the number of concepts; elsewhere k <= width."""
REQUIRED_KEYS = ("n_concepts", "hidden_size", "site", "method", "model", "config", "encoder_keys", "stats_keys")


class ConceptSet:
    """Directions `(n, d)` at a site, with the metadata needed to use them again.

    `encoder` holds optional extractor weights (an SAE's encoder, a VQ codebook) as named
    tensors; `stats` holds per-concept statistics, each a tensor whose first dimension is n.
    `config` is the method's JSON-serialisable configuration. `mean` `(d,)`, when the fit
    recorded it, is the mean activation of the rows the extractor saw (see `centred`).
    """

    def __init__(
        self,
        directions: Tensor,
        site: str | None = None,
        *,
        method: str = "custom",
        config: dict[str, Any] | None = None,
        model: str | None = None,
        hidden_size: int | None = None,
        encoder: dict[str, Tensor] | None = None,
        stats: dict[str, Tensor] | None = None,
        mean: Tensor | None = None,
    ) -> None:
        directions = torch.as_tensor(directions)
        if directions.ndim == 1:
            directions = directions[None]
        if directions.ndim != 2:
            raise ValueError(f"directions must have shape (n, d) or (d,); got {tuple(directions.shape)}")
        n, d = directions.shape
        if hidden_size is not None and hidden_size != d:
            raise ValueError(f"directions have width {d} but hidden_size is {hidden_size}")
        stats = dict(stats or {})
        for key, value in stats.items():
            if value.shape[:1] != (n,):
                raise ValueError(f"stats[{key!r}] has shape {tuple(value.shape)}; its first dimension must be n={n}")
        self.directions = directions.detach().float()
        self.site = site
        self.method = canonical(method)  # sets saved under a method's older name read as its one name
        self.config = dict(config or {})
        self.model = model
        self.d = d
        """The directions' width (d of the site's rows; H*d_head at a q/k/v site)."""
        self.encoder = {k: v.detach() for k, v in (encoder or {}).items()}
        self.stats = {k: v.detach() for k, v in stats.items()}
        if mean is not None:
            mean = torch.as_tensor(mean).detach().float().reshape(-1)
            if mean.shape != (d,):
                raise ValueError(f"mean has shape {tuple(mean.shape)}; it must be ({d},), one value per dimension")
        self.mean = mean

    def centred(self) -> ConceptSet:
        """The same concepts with the fit's mean activation taken out of their directions.

            Add(cs.centred()[12], alpha=0.5, scale="robust_norm")  # steer along what concept 12 adds

        Centroids and codes (k-means, VQ) are points near the mean activation, so raw they
        point mostly along the mean (median cosine 0.87 on SmolLM2 block 15): steering with one adds the
        mean, projecting one out removes it. Centred, they are `c - mean`. Directions that are
        differences of activations (`DIFFERENCE_METHODS`, Deleuzian) lose their component
        along the mean instead: `c - (c . m) m / |m|^2`. Raises if the set carries no mean.
        """
        if self.mean is None:
            if self.method in names(concepts="decoder"):
                raise ValueError(f"{self!r} is an SAE's: its decoder rows are directions already, with no centred "
                                 "form; steer and ablate with the set as it is")
            raise ValueError(f"{self!r} carries no mean activation: only sets fitted by k-means, Deleuzian or VQ "
                             "record one (or pass mean= when building the set)")
        if self.config.get("centred"):
            return self
        mean = self.mean.double()
        d = self.directions.double()
        if self.method in DIFFERENCE_METHODS:
            centred = d - (d @ mean)[:, None] * mean / mean.pow(2).sum().clamp_min(1e-300)
        else:
            centred = d - mean
        return ConceptSet(centred.float(), self.site, method=self.method, model=self.model,
                          config={**self.config, "centred": True}, stats=self.stats, mean=self.mean)

    def __len__(self) -> int:
        return self.directions.shape[0]

    @property
    def hidden_size(self) -> int:
        """The same as `d`, kept for earlier code (the file's key keeps this name): the directions'
        width, which is not the model's hidden size at a q/k/v or MLP-neuron site."""
        return self.d

    def __repr__(self) -> str:
        return (f"ConceptSet(n={len(self)}, d={self.d}, site={self.site!r}, "
                f"method={self.method!r}, model={self.model!r})")

    def __getitem__(self, index: int | slice | Sequence[int] | Tensor) -> ConceptSet:
        """A smaller set with the chosen concepts (encoder weights are dropped: they are whole-set)."""
        if isinstance(index, int):
            if not -len(self) <= index < len(self):
                raise IndexError(f"concept {index} out of range for a set of {len(self)}")
            index = [index]
        idx = torch.arange(len(self))[index]
        if idx.ndim == 0:
            idx = idx[None]
        return ConceptSet(
            self.directions[idx], self.site, method=self.method, model=self.model,
            config={**self.config, "parent_indices": idx.tolist()},
            stats={k: v[idx] for k, v in self.stats.items()}, mean=self.mean,
        )

    def to_config(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "n_concepts": len(self), "hidden_size": self.d, "site": self.site,
            "method": self.method, "model": self.model, "config": self.config,
            "encoder_keys": sorted(self.encoder), "stats_keys": sorted(self.stats),
        }

    def _tensors(self) -> dict[str, Tensor]:
        """The tensors `save` writes, by their names in the file."""
        tensors = {"directions": self.directions.contiguous()}
        tensors |= {f"encoder.{k}": v.contiguous() for k, v in self.encoder.items()}
        tensors |= {f"stats.{k}": v.contiguous() for k, v in self.stats.items()}
        if self.mean is not None:
            tensors["mean"] = self.mean.contiguous()
        return tensors

    def digest(self) -> str:
        """The sha256 of the set's tensors, as `save` records it in config.json."""
        return tensor_digest(self._tensors())

    def save(self, directory: str | os.PathLike) -> Path:
        """Write `concepts.safetensors` and `config.json` into `directory`, atomically as a whole.

        The tensor file carries its own copy of the config (and config.json a sha256 of the
        tensors) and is renamed into place first: that rename is the commit, so a save
        killed at any point leaves the old set or the new one, never a mix.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        remove_leftovers(directory, (TENSOR_FILE, CONFIG_FILE))
        tensors = self._tensors()
        text = json.dumps({**self.to_config(), "sha256": tensor_digest(tensors)}, indent=2)
        atomic_write(directory / TENSOR_FILE,
                     lambda p: save_file(tensors, p, metadata={"format": FORMAT, "config": text}))
        atomic_write(directory / CONFIG_FILE, lambda p: Path(p).write_text(text))
        return directory

    @classmethod
    def load(cls, directory: str | os.PathLike) -> ConceptSet:
        """Read a set written by `save`; refuses files that are not one, are corrupt or do not agree."""
        directory = Path(directory)
        config_path, tensor_path = directory / CONFIG_FILE, directory / TENSOR_FILE
        if not tensor_path.is_file():
            raise FileNotFoundError(f"{tensor_path} not found: a ConceptSet folder holds {CONFIG_FILE} and "
                                    f"{TENSOR_FILE}")
        tensors, stored = _read_tensors(tensor_path)
        config = _read_config(config_path, stored, tensor_path)
        if "sha256" in config and (digest := tensor_digest(tensors)) != config["sha256"]:
            raise ValueError(f"{tensor_path} is corrupt: the sha256 of its tensors is {digest[:16]}..., "
                             f"its config records {str(config['sha256'])[:16]}...")
        directions = tensors.get("directions")
        expected = (config["n_concepts"], config["hidden_size"])
        if directions is None or tuple(directions.shape) != expected:
            got = None if directions is None else tuple(directions.shape)
            raise ValueError(f"{tensor_path} holds directions of shape {got}; {config_path} says {expected}")
        encoder = {k[8:]: v for k, v in tensors.items() if k.startswith("encoder.")}
        stats = {k[6:]: v for k, v in tensors.items() if k.startswith("stats.")}
        if sorted(encoder) != config["encoder_keys"] or sorted(stats) != config["stats_keys"]:
            raise ValueError(f"{tensor_path} and {config_path} list different tensors")
        check_concept_tensors(tensor_path, "the set", directions, encoder, tensors.get("mean"))
        return cls(directions, config["site"], method=config["method"], config=config["config"],
                   model=config["model"], encoder=encoder, stats=stats, mean=tensors.get("mean"))

    @classmethod
    def from_pretrained(cls, repo_or_path: str | os.PathLike, **kwargs: Any) -> ConceptSet:
        """Load from a local folder or a Hub repo (`subfolder=`, `revision=`, ...); see `concepts.hub`."""
        from conceptlens.concepts.hub import from_pretrained

        return from_pretrained(repo_or_path, **kwargs)

    def push_to_hub(self, repo_id: str, **kwargs: Any) -> Any:
        """Upload this set with a model card (`subfolder=`, `private=`, ...); see `concepts.hub`."""
        from conceptlens.concepts.hub import push_to_hub

        return push_to_hub(self, repo_id, **kwargs)


def _read_tensors(path: Path) -> tuple[dict[str, Tensor], str | None]:
    """The tensors of a set's file and the config text stored in it (None in version-1 files)."""
    tensors, metadata = read_safetensors(path)
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path} is not a ConceptSet tensor file (expected format {FORMAT!r})")
    return tensors, metadata.get("config")


def _read_config(config_path: Path, stored: str | None, tensor_path: Path) -> dict[str, Any]:
    """The set's config: the copy inside the tensor file (the commit point) when there is one,
    checked against config.json; config.json alone for version-1 sets."""
    if stored is None:
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path} not found: a ConceptSet folder holds {CONFIG_FILE} and "
                                    f"{TENSOR_FILE}")
        return _parse_config(config_path.read_bytes(), config_path)
    config = _parse_config(stored.encode(), tensor_path)
    if not config_path.is_file() or config_path.read_bytes() == stored.encode():
        return config
    try:
        mirror = parse_json(config_path.read_bytes(), config_path)
    except ValueError:
        mirror = None
    if not isinstance(mirror, dict) or mirror.get("sha256") != config.get("sha256"):
        warnings.warn(f"{config_path} is not the config of {tensor_path} (an interrupted save, or a corrupt "
                      f"file); using the copy stored in {tensor_path}", stacklevel=3)
        return config
    keys = sorted(k for k in set(config) | set(mirror) if config.get(k) != mirror.get(k))
    raise ValueError(f"{config_path} and {tensor_path} disagree on {keys}: one of them was edited or is corrupt")


def _parse_config(raw: bytes, path: Path) -> dict[str, Any]:
    config = parse_json(raw, path)
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise ValueError(f"{path} is not a ConceptSet config (expected format {FORMAT!r})")
    if config.get("format_version") not in READABLE_VERSIONS:
        raise ValueError(f"{path} has format_version {config.get('format_version')!r}; "
                         f"this version reads {list(READABLE_VERSIONS)}")
    missing = [key for key in REQUIRED_KEYS if key not in config]
    if missing:
        raise ValueError(f"{path} lacks the key{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}; "
                         f"a ConceptSet config has {', '.join(REQUIRED_KEYS)}")
    _check_types(path, config)
    return config


def _check_types(path: Path, config: dict[str, Any]) -> None:
    """The JSON types of a set's config, and the ranges of the counts its method's config declares."""
    n = field(path, "n_concepts", config["n_concepts"], int, low=0, high=MAX_COUNT)
    field(path, "hidden_size", config["hidden_size"], int, low=1, high=MAX_COUNT)
    for key in ("site", "model"):
        field(path, key, config[key], str, optional=True)
    field(path, "method", config["method"], str)
    inner = field(path, "config", config["config"], dict)
    for key in ("encoder_keys", "stats_keys"):
        if not all(isinstance(k, str) for k in field(path, key, config[key], list)):
            raise ValueError(f"{path}: {key} must be a list of strings; got {config[key]!r}")
    field(path, "sha256", config.get("sha256"), str, optional=True)
    width = field(path, "config.width", inner.get("width"), int, low=1, high=MAX_COUNT, optional=True)
    field(path, "config.n_concepts", inner.get("n_concepts"), int, low=1, high=MAX_COUNT, optional=True)
    k_high = MAX_COUNT if canonical(config["method"]) in K_PAST_WIDTH else width or max(n, 1)
    field(path, "config.k", inner.get("k"), int, low=1, high=k_high, optional=True)
