"""What the code below the Lens needs of a model with conceptlens attached: a narrow protocol.

    def site_norm(lens: AttachedModel, site: str) -> float: ...   # fit, steering, metrics, describe

`Lens` implements it. `fit`, `steering`, `metrics` and `describe` depend on this protocol, not
on the Lens (nothing below lens.py imports it, not even for typing), so they can be used with
any object that has these members, and the import layers stay one-way (pyproject.toml).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Iterable, Protocol

import torch
from torch import nn

from conceptlens.hooks.capture import Capture, OnBatch
from conceptlens.hooks.handles import Handle
from conceptlens.hooks.manager import HookManager
from conceptlens.hooks.points import SiteFn
from conceptlens.sites.site import Site


class AttachedModel(Protocol):
    """A model, its tokenizer and the scopes that read and edit its sites."""

    model: nn.Module
    tokenizer: Any
    stacks: dict[str, nn.Module]
    """Token space ("" for single-stack models, "encoder", "decoder") -> the module that runs its blocks."""
    hooks: HookManager
    """Everything put on the model: hooks, patches, the steering scopes and the site-norm cache."""

    @property
    def name(self) -> str:
        """The model's portable id (registered name, hub id or a local folder's name)."""

    @property
    def sites(self) -> dict[str, Site]:
        """Every site of the model, by canonical name."""

    def site(self, name: str) -> Site:
        """The site `name` resolves to; KeyError with the valid names otherwise."""

    def hook(self, site: str | Site, fn: SiteFn) -> Handle:
        """Run `fn(tensor) -> None | tensor` at a site until the handle is removed."""

    def capture(self, sites: str | Site | Iterable[str | Site], on_batch: OnBatch | None = None, *,
                keep_shape: bool = False, drop_special: bool = False,
                dtype: torch.dtype | str = torch.float32) -> Capture:
        """A scope streaming the activations of `sites` (see `Lens.capture`)."""

    def steer(self, *edits: Any, positions: Any = "all") -> AbstractContextManager[Any]:
        """A scope applying steering edits at their sites (see `Lens.steer`)."""
