"""ConceptSet: concept directions in one site's activation space, saved without pickle.

    cs = ConceptSet(torch.randn(8, 576), site="blocks.5.resid_out", method="probe")
    cs.save("run/concepts")                    # concepts.safetensors + config.json
    cs = ConceptSet.load("run/concepts")
    cs[3], cs[[3, 7]]                          # smaller ConceptSets
    cs.centred()                               # directions measured from the fit's mean activation
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from conceptlens._io import atomic_write

FORMAT = "conceptlens.ConceptSet"
FORMAT_VERSION = 1
DIFFERENCE_METHODS = frozenset({"deleuzian"})
"""Methods whose directions are differences of activations, not points among them (see `centred`)."""
TENSOR_FILE = "concepts.safetensors"
CONFIG_FILE = "config.json"


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
        self.method = method
        self.config = dict(config or {})
        self.model = model
        self.hidden_size = d
        self.encoder = {k: v.detach() for k, v in (encoder or {}).items()}
        self.stats = {k: v.detach() for k, v in stats.items()}
        if mean is not None:
            mean = torch.as_tensor(mean).detach().float().reshape(-1)
            if mean.shape != (d,):
                raise ValueError(f"mean has shape {tuple(mean.shape)}; it must be ({d},), one value per dimension")
        self.mean = mean

    def centred(self) -> ConceptSet:
        """The same concepts with the fit's mean activation taken out of their directions.

            Add(cs.centred()[12], alpha=0.5, scale="site_norm")    # steer along what concept 12 adds

        Centroids and codes (k-means, VQ) are points near the mean activation, so raw they
        point mostly along the mean (cosine 0.8-0.9 on SmolLM2): steering with one adds the
        mean, projecting one out removes it. Centred, they are `c - mean`. Directions that are
        differences of activations (`DIFFERENCE_METHODS`, Deleuzian) lose their component
        along the mean instead: `c - (c . m) m / |m|^2`. Raises if the set carries no mean.
        """
        if self.mean is None:
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

    def __repr__(self) -> str:
        return (f"ConceptSet(n={len(self)}, d={self.hidden_size}, site={self.site!r}, "
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
            "n_concepts": len(self), "hidden_size": self.hidden_size, "site": self.site,
            "method": self.method, "model": self.model, "config": self.config,
            "encoder_keys": sorted(self.encoder), "stats_keys": sorted(self.stats),
        }

    def save(self, directory: str | os.PathLike) -> Path:
        """Write `concepts.safetensors` and `config.json` into `directory`, each atomically."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {"directions": self.directions.contiguous()}
        tensors |= {f"encoder.{k}": v.contiguous() for k, v in self.encoder.items()}
        tensors |= {f"stats.{k}": v.contiguous() for k, v in self.stats.items()}
        if self.mean is not None:
            tensors["mean"] = self.mean.contiguous()
        atomic_write(directory / TENSOR_FILE, lambda p: save_file(tensors, p, metadata={"format": FORMAT}))
        text = json.dumps(self.to_config(), indent=2)
        atomic_write(directory / CONFIG_FILE, lambda p: Path(p).write_text(text))
        return directory

    @classmethod
    def load(cls, directory: str | os.PathLike) -> ConceptSet:
        """Read a set written by `save`; refuses files that are not one or do not agree."""
        directory = Path(directory)
        config_path, tensor_path = directory / CONFIG_FILE, directory / TENSOR_FILE
        for path in (config_path, tensor_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path} not found: a ConceptSet folder holds {CONFIG_FILE} and {TENSOR_FILE}")
        try:
            config = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{config_path} is not valid JSON: {err}") from None
        if not isinstance(config, dict) or config.get("format") != FORMAT:
            raise ValueError(f"{config_path} is not a ConceptSet config (expected format {FORMAT!r})")
        if config.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{config_path} has format_version {config.get('format_version')!r}; "
                             f"this version reads {FORMAT_VERSION}")
        try:
            tensors = load_file(tensor_path)
        except (SafetensorError, OSError, ValueError) as err:
            raise ValueError(f"{tensor_path} is not a readable safetensors file: {err}") from None
        directions = tensors.get("directions")
        expected = (config["n_concepts"], config["hidden_size"])
        if directions is None or tuple(directions.shape) != expected:
            got = None if directions is None else tuple(directions.shape)
            raise ValueError(f"{tensor_path} holds directions of shape {got}; {config_path} says {expected}")
        encoder = {k[8:]: v for k, v in tensors.items() if k.startswith("encoder.")}
        stats = {k[6:]: v for k, v in tensors.items() if k.startswith("stats.")}
        if sorted(encoder) != config["encoder_keys"] or sorted(stats) != config["stats_keys"]:
            raise ValueError(f"{tensor_path} and {config_path} list different tensors")
        return cls(directions, config["site"], method=config["method"], config=config["config"],
                   model=config["model"], encoder=encoder, stats=stats, mean=tensors.get("mean"))

