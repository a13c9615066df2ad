"""The fit's configuration: one `FitConfig`, with overrides by name, for `Lens.fit`, `describe`
and the CLI.

    config = fit_config(FitConfig(batch_size=8), "Lens.fit", max_tokens=50_000)
"""

from __future__ import annotations

import os

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from conceptlens._checks import check_int, unknown_message
from conceptlens.filters import FilterConfig


@dataclass
class FitConfig:
    """How texts become batches and how often the fit is saved."""

    batch_size: int = 16
    """Documents per forward."""
    max_length: int = 128
    """Tokens per document; longer documents are truncated."""
    max_tokens: int | None = None
    """Stop after the batch that reaches this many real tokens (None: the whole source)."""
    extractor_tokens: dict[str, int] = field(default_factory=dict)
    """Per extractor name, its own budget: it is fed no batch after the one that reaches this many
    real tokens, as `max_tokens` stops the fit, while the others go on (the fit stops once every
    extractor is done). One pass can so fit a k-means on more tokens than an SAE."""
    checkpoint_dir: str | None = None
    """Folder for `checkpoint.pt` and, at the end, one ConceptSet folder per extractor."""
    checkpoint_every: int | None = None
    """Write a checkpoint each time this many more tokens have been seen."""
    resume: bool = True
    """Continue from `checkpoint_dir/checkpoint.pt` when it exists."""
    progress: bool = True
    """Show a tqdm bar of tokens and tokens/s."""
    filters: FilterConfig = field(default_factory=FilterConfig)
    """Token hygiene: attention sinks and non-finite rows never reach extractors."""
    dtype: torch.dtype | str = torch.float32
    """dtype of the rows extractors get: float32, or "model" for the model's own (e.g. bf16)."""
    distributed: bool = False
    """Fit across the processes of a torch.distributed group (see conceptlens/distributed.py):
    documents sharded by rank, `batch_size` documents per rank per step, rank 0 writes."""

    def __post_init__(self) -> None:
        check_int("batch_size", self.batch_size)
        check_int("max_length", self.max_length)
        check_int("max_tokens", self.max_tokens, optional=True)
        if not isinstance(self.extractor_tokens, dict):
            raise ValueError(f"extractor_tokens must map extractor names to token counts; got {self.extractor_tokens!r}")
        for name, tokens in self.extractor_tokens.items():
            if not isinstance(name, str):
                raise ValueError(f"extractor_tokens is keyed by extractor names (a pair's is 'SOURCE->TARGET', "
                                 f"as the fit names it); got the key {name!r}")
            check_int(f"extractor_tokens[{name!r}]", tokens)
        check_int("checkpoint_every", self.checkpoint_every, optional=True)
        if self.checkpoint_dir is not None and not (isinstance(self.checkpoint_dir, (str, os.PathLike))
                                                    and str(self.checkpoint_dir)):
            raise ValueError(f"checkpoint_dir must be a folder path, or None for no checkpoint; got "
                             f"{self.checkpoint_dir!r}")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ValueError("checkpoint_every needs checkpoint_dir")
        for name in ("resume", "progress", "distributed"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False; got {getattr(self, name)!r}")
        if not isinstance(self.filters, FilterConfig):
            raise ValueError(f"filters must be a FilterConfig (e.g. FilterConfig(first_position=False)) or None for "
                             f"the defaults; got {self.filters!r}")
        if not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point) and self.dtype != "model":
            raise ValueError(f"dtype must be a floating torch dtype (torch.float32, torch.bfloat16) or \"model\" "
                             f"(the model's own); got {self.dtype!r}")


def fit_config(config: FitConfig | None = None, what: str = "fit", /, **overrides: Any) -> FitConfig:
    """`config` (default `FitConfig()`) with `overrides` replacing its fields: the one place the
    fit options are named, for `Lens.fit`, `describe` and the CLI. `filters=None` keeps the
    default filters; an unknown name is a TypeError listing the fields (`what`: who took them)."""
    names = [f.name for f in fields(FitConfig)]
    unknown = [key for key in overrides if key not in names]
    if unknown:
        raise TypeError(unknown_message(what, unknown, names))
    if "filters" in overrides and overrides["filters"] is None:
        overrides["filters"] = FilterConfig()
    return replace(config or FitConfig(), **overrides)
