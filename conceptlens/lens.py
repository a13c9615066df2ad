"""Lens: ties an adapter, hooks, fitting and steering to one model.

    lens = conceptlens.attach(model, tokenizer)
    lens.sites                                   # name -> Site, every site of the model
    print(lens.site("blocks.-1.attn.k"))
    with lens.capture(["blocks.3.resid_out"], on_batch=fn):
        model(**batch)

Attaching registers nothing: hooks exist only inside the scopes (`capture`, `hook`, and the
steering and fitting scopes built on them), so a lens with no scope open leaves the model
exactly as it was. Every hook goes through the lens's HookManager (`lens.hooks`, one per
lens); `lens.close()`, or leaving `with conceptlens.attach(model) as lens:`, removes whatever
is still attached.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping
from weakref import WeakKeyDictionary, WeakSet

import torch
from torch import Tensor, nn

from conceptlens._checks import known_kwargs
from conceptlens.adapters.adapter import Adapter, get_path
from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.fit import FitConfig, FitReport, fit_config
from conceptlens.fit import fit as run_fit
from conceptlens.hooks.capture import Capture, OnBatch
from conceptlens.hooks.handles import Handle
from conceptlens.hooks.manager import HookManager
from conceptlens.hooks.points import SiteFn, hook_site
from conceptlens.sites.site import Site
from conceptlens.steering.edits import Edit, ProjectOut
from conceptlens.steering.scope import Positions, Steer
from conceptlens.wrappers import unwrap

if TYPE_CHECKING:
    from conceptlens.steering.ablate import Mode


_MANAGERS: WeakKeyDictionary[nn.Module, WeakSet[HookManager]] = WeakKeyDictionary()
"""Model -> the hook managers of the lenses attached to it (weakly): the one table across lenses, read
only by `HookManager.private_forward`, so the library's own probe forward runs unsteered under every lens."""
_MANAGERS_LOCK = threading.Lock()


def _register(model: nn.Module, hooks: HookManager) -> Callable[[], list[HookManager]]:
    """Record `hooks` as a manager of `model`; returns the live managers of the model, on each call."""
    with _MANAGERS_LOCK:
        managers = _MANAGERS.setdefault(model, WeakSet())
        managers.add(hooks)

    def peers() -> list[HookManager]:
        with _MANAGERS_LOCK:
            return [m for m in managers if not m.closed]

    return peers


class Lens:
    """The sites of one model and the scopes that read and edit them."""

    def __init__(self, model: nn.Module, tokenizer: Any = None) -> None:
        model, tokenizer = unwrap(model, tokenizer)  # an nnsight NNsight / LanguageModel: its module
        if not isinstance(model, nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"attach() needs a Hugging Face transformers model (an nn.Module with .config); "
                            f"got {type(model).__name__}")
        self.model = model
        self.tokenizer = tokenizer
        self.hooks = HookManager(model)
        """Every hook, patch and hook table of this lens on the model (hooks/manager.py)."""
        self.hooks.peers = _register(model, self.hooks)
        self.adapter = Adapter(model, hooks=self.hooks)
        base = getattr(model, "base_model", model)
        self.stacks: dict[str, nn.Module] = {name: get_path(base, path)
                                             for name, path in self.adapter.spec.stacks.items()}

    def __repr__(self) -> str:
        blocks = ", ".join(f"{k or 'blocks'}: {n}" for k, n in self.adapter.n_blocks.items())
        return f"Lens({type(self.model).__name__}, model_type={self.adapter.model_type!r}, {blocks}, {len(self.sites)} sites)"

    @property
    def sites(self) -> dict[str, Site]:
        """Every site, by canonical name, in model order."""
        return self.adapter.sites

    @property
    def name(self) -> str:
        """The model's portable id (registered name, hub id, or a local folder's name; never an absolute path)."""
        from conceptlens.models import portable_id

        name = getattr(self.model, "name_or_path", "") or getattr(self.model.config, "_name_or_path", "")
        return portable_id(name) if name else type(self.model).__name__

    def site(self, name: str) -> Site:
        """Describe one site; `KeyError` with close valid names if there is none.

        Also accepts TransformerLens hook names (`blocks.5.hook_resid_post`, `blocks.5.attn.hook_rot_q`)
        and Hugging Face module paths (`model.layers.5` -> the module's output site); the returned
        Site's `name` is the canonical name it maps to (see `site_name`).
        """
        return self.adapter.resolve(name)

    def site_name(self, name: str) -> str:
        """The canonical site name that `name` (canonical, TransformerLens or HF path) maps to."""
        return self.adapter.resolve(name).name

    def hook(self, site: str | Site, fn: SiteFn) -> Handle:
        """Low-level: run `fn(tensor) -> None | tensor` at a site until the handle is removed; a
        returned tensor replaces the site's value, cast to its dtype (a float32 result on a bf16 model)."""
        def run(x: Tensor) -> Tensor | None:
            out = fn(x)
            return out.to(x.dtype) if isinstance(out, Tensor) and out.dtype != x.dtype else out

        return hook_site(self.hooks, self._site(site), run)

    @known_kwargs
    def capture(self, sites: str | Site | Iterable[str | Site], on_batch: OnBatch | None = None, *,
                keep_shape: bool = False, drop_special: bool = False,
                dtype: torch.dtype | str = torch.float32) -> Capture:
        """Context manager streaming the activations of `sites` to `on_batch(acts, meta)`.

        acts: site name -> float32 `(N, d)` (or `(N, H, d_head)` for q/k/v) with padding
        dropped and rows aligned across sites; `(B, T, ...)` with `keep_shape=True`.
        `drop_special` also drops the tokenizer's special tokens (needs the tokenizer).
        `dtype`: float32 by default; `"model"` keeps each site's own dtype (half the memory of
        a bf16 model's copies). Each site's tensors stay on the device its layer ran on.
        """
        if isinstance(sites, (str, Site)):
            sites = [sites]
        elif not isinstance(sites, Iterable) or isinstance(sites, (bytes, Mapping)):
            raise TypeError(f"sites must be a site name, a Site or a list of them; got {type(sites).__name__} "
                            f"{sites!r:.60}")
        resolved = [self._site(s) for s in sites]
        special = None
        if drop_special:
            if self.tokenizer is None:
                raise ValueError("drop_special=True needs a tokenizer: conceptlens.attach(model, tokenizer)")
            special = torch.tensor(sorted(self.tokenizer.all_special_ids), dtype=torch.long)
        return Capture(self.hooks, resolved, self.stacks, on_batch, keep_shape=keep_shape, special_ids=special,
                       dtype=dtype)

    def fit(self, extractors: Mapping[str | tuple[str, str], Any], data: Any, *, tokenizer: Any = None,
            config: FitConfig | None = None, **overrides: Any) -> FitReport:
        """Stream `data` once through the model into every extractor (see `conceptlens.fit`).

        `config` (a `FitConfig`) and keyword overrides of its fields (`batch_size`, `max_length`,
        `max_tokens`, `checkpoint_dir`, `checkpoint_every`, `resume`, `progress`, `filters`,
        `dtype`, `distributed`) say how texts become batches and how often the fit is saved.

        `extractors` maps a site, or a `(source_site, target_site)` pair for cross-layer
        extractors, to an extractor or to `{name: extractor}` (several per site, reported and
        saved under their names); `data` is a list of strings, a .txt/.jsonl path, a
        datasets.Dataset or a bundled set name (`conceptlens.data`).
        `distributed=True` fits across the processes of a torch.distributed group (torchrun), see
        conceptlens/distributed.py.
        """
        return run_fit(self, extractors, data, tokenizer=tokenizer, config=fit_config(config, "Lens.fit", **overrides))

    def describe(self, concept_sets: Mapping[str, ConceptSet], data: Any, **kwargs: Any) -> dict[str, Any]:
        """Describe fitted concept sets over (held-out) documents: top contexts, histograms,
        neighbours, promoted tokens, per-class probes; see `conceptlens.describe.describe`."""
        from conceptlens.describe import describe
        from conceptlens.runlock import lock

        out = kwargs.get("out")
        with lock(out, "describe") if out is not None else nullcontext():  # one writer of the folder
            return describe(self, concept_sets, data, **kwargs)

    @known_kwargs
    def steer(self, *edits: Edit, positions: Positions = "all") -> Steer:
        """Context manager applying `edits` (Add, ProjectOut, Clamp, CodeAblate) at their sites.

        positions: "all", "prompt" (the first forward in the scope), "generated" (later
        forwards) or a slice of absolute token positions.
        """
        return Steer(self, edits, positions)

    @known_kwargs
    def ablate(self, concepts: ConceptSet | Tensor, *, site: str | None = None,
               positions: Positions = "all", mode: Mode = "projection", mean: Tensor | None = None) -> Steer:
        """Ablate the concept directions at their site: `mode` "projection" (ProjectOut, the
        default), "mean" (component replaced by the mean activation's: `mean`, or the set's own) or
        "zero" (see `steering.ablate`)."""
        if mean is not None and mode != "mean":
            raise ValueError(f"mean= is read only by mode='mean'; got mode={mode!r}")
        if mode == "projection":
            return Steer(self, [ProjectOut(concepts, site=site)], positions)
        from conceptlens.steering.ablate import Ablate

        return Steer(self, [Ablate(concepts, mode, mean=mean, site=site)], positions)

    def close(self) -> None:
        """Remove every hook and patch this lens has on the model (open scopes included); the
        model is then exactly as before `attach`. Safe to call twice; the lens hooks nothing after."""
        self.hooks.close()

    def __enter__(self) -> Lens:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _site(self, site: str | Site) -> Site:
        if isinstance(site, Site):
            own = self.sites.get(site.name)
            if own is None or own.module is not site.module or own.point != site.point:
                raise ValueError(f"site {site.name!r} belongs to another model")
            return own  # this lens's own (a lens of the same model describes the same site)
        return self.site(site)


@known_kwargs
def attach(model: nn.Module, tokenizer: Any = None) -> Lens:
    """Wrap a Hugging Face model (encoder, decoder or encoder-decoder) in a Lens; an nnsight
    `NNsight` / `LanguageModel` wrapper of one is accepted too (its tokenizer comes along)."""
    return Lens(model, tokenizer)
