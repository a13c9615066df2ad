"""Edits: what steering does to a site's activations.

    Add(cs[12], alpha=6.0)                 # x + alpha * c  (the raw direction)
    Add(cs[12], alpha=0.5, scale="robust_norm")  # x + 0.5 * (typical token norm) * c / |c|
    ProjectOut(cs[[3, 7]])                 # remove the span of the directions
    Clamp(sae, latent=42, value=0.0)       # set one SAE latent, keep the SAE's error
    CodeAblate(codebook, codes=[5])        # remove the code vector from tokens assigned to it

Each edit is bound to a site: the ConceptSet's, or `site=` when given a raw tensor or an
extractor. `apply(x, mask)` edits the rows of `x` (`(B, T, d)`) where `mask` (`(B, T)`
bool, or None for all) is true.
"""

from __future__ import annotations

import copy
import math
import warnings
from numbers import Real
from typing import Any, Literal, Sequence

import torch
from torch import Tensor

from conceptlens._checks import known_kwargs
from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.interface import AttachedModel

Concepts = ConceptSet | Tensor
Scale = Literal["raw", "unit", "robust_norm", "site_norm"]
SCALES = ("raw", "unit", "robust_norm", "site_norm")
MEASURED = ("robust_norm", "site_norm")
"""Scales whose unit the lens measures at the site (`steering.units`) when a scope is built."""


def _directions(concepts: Concepts) -> Tensor:
    d = concepts.directions if isinstance(concepts, ConceptSet) else torch.as_tensor(concepts)
    if d.ndim == 1:
        d = d[None]
    if d.ndim != 2:
        raise ValueError(f"directions must have shape (d,) or (n, d); got {tuple(d.shape)}")
    d = d.detach().float()
    bad = (~torch.isfinite(d)).any(dim=1).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"direction{'s' if len(bad) > 1 else ''} {bad[:8]} of the {d.shape[0]} given hold NaN or "
                         "inf values; an edit needs finite directions")
    return d


def _number(name: str, value: Any) -> float:
    """A finite real number (not a bool), as float; ValueError naming the value otherwise."""
    ok = isinstance(value, Real) or (isinstance(value, Tensor) and value.numel() == 1)  # numpy scalars too
    number = float(value) if ok and not isinstance(value, bool) else math.nan
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number; got {value!r}")
    return number


def _indices(name: str, value: Any) -> Tensor:
    """An int or a sequence of ints (no bools) as a long tensor."""
    items = [value] if isinstance(value, int) else list(value) if isinstance(value, Sequence) else [value]
    if not items or any(isinstance(i, bool) or not isinstance(i, int) for i in items):
        raise ValueError(f"{name} must be an int or a list of ints; got {value!r}")
    return torch.as_tensor(items, dtype=torch.long)


def _site_of(concepts: Any, site: str | None) -> str:
    site = site or getattr(concepts, "site", None)
    if not site:
        raise ValueError(f"{type(concepts).__name__} carries no site; pass site='blocks.{{i}}.resid_out' "
                         "(or another site name)")
    return site


class Edit:
    """Base: a change applied to one site's activations."""

    site: str
    width: int | None = None
    """Row width the edit works in (None: not known until it runs)."""
    model: str | None = None
    """Model the edit's concepts were recorded for, when they say."""

    def check(self, site: str, width: int, model: str | None) -> None:
        """Called when a scope is built on a model: ValueError if the edit's width is not the
        site's, a warning if its concepts were recorded for another model."""
        if self.width is not None and self.width != width:
            raise ValueError(f"{type(self).__name__} at {site}: its direction has width {self.width}, but {site} "
                             f"has width {width}")
        if self.model and model and self.model != model:
            warnings.warn(f"{type(self).__name__} at {site}: the concepts were recorded for model {self.model!r}; "
                          f"this model is {model!r}", UserWarning, stacklevel=4)

    def bind(self, lens: AttachedModel) -> None:
        """Called when a steering scope is built on `lens`: measure what the edit needs of it."""

    def apply(self, x: Tensor, mask: Tensor | None) -> Tensor:
        """(B, T, d) activations and an optional (B, T) mask -> edited activations."""
        raise NotImplementedError

    @staticmethod
    def _select(x: Tensor, new: Tensor, mask: Tensor | None) -> Tensor:
        return new if mask is None else torch.where(mask[..., None], new, x)


class Add(Edit):
    """x + alpha * v, v the sum of the concepts' directions, scaled by `scale`:

    - "raw": v as given (a k-means centroid's norm is about a token's norm);
    - "unit": v / |v|, so alpha is a distance in the site's activation space;
    - "robust_norm": v / |v| times the site's typical token norm without its massive
      coordinates (`steering.units.robust_norm`, measured by the lens when the scope is built,
      or `norm=`), so alpha is a multiple of it: 0.5 adds half a typical token whatever the
      model's activation scale, on models with massive activations too;
    - "site_norm": the same with the plain median token norm (`steering.units.site_norm`),
      which one massive coordinate can set (Gemma-3).

    Adds at one site are summed into one vector first, so Add(alpha) and Add(-alpha)
    together leave every activation bit-identical.
    """

    @known_kwargs
    def __init__(self, concepts: Concepts, alpha: float = 1.0, *, scale: Scale = "raw", norm: float | None = None,
                 site: str | None = None) -> None:
        if scale not in SCALES:
            raise ValueError(f"scale must be one of {SCALES}; got {scale!r}")
        if norm is not None and not _number("norm", norm) > 0:
            raise ValueError(f"norm must be a positive number (a typical token norm); got {norm!r}")
        self.site = _site_of(concepts, site)
        self.alpha, self.scale = _number("alpha", alpha), scale
        direction = _directions(concepts).sum(0)  # (d,)
        if scale != "raw":
            length = direction.norm()
            if not length > 0:
                raise ValueError(f"scale={scale!r} needs a direction of nonzero norm; the concepts sum to zero")
            direction = direction / length
        self.direction = direction
        self.width, self.model = direction.shape[0], getattr(concepts, "model", None)
        self.norm = None if norm is None else float(norm)  # measured scales: the token norm alpha multiplies
        self._fixed_norm = norm is not None
        self._vector = None if scale in MEASURED and norm is None else self._scaled()

    def _scaled(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """alpha * scale * direction, refused when it overflows `dtype` (float32 here; the model's
        dtype when bound): alpha is checked finite where it is used, not in float64."""
        factor = 1.0
        if self.scale in MEASURED:
            if self.norm is None:
                raise RuntimeError(f"scale={self.scale!r} multiplies the site's measured norm, which this edit has "
                                   "not got yet: it is measured when a lens steers with the edit")
            factor = self.norm
        vector = self.alpha * factor * self.direction
        if not bool(torch.isfinite(vector.to(dtype)).all()):
            unit = f" x {self.scale} {self.norm:.4g}" if self.scale in MEASURED else ""
            raise ValueError(f"alpha={self.alpha:g}{unit} overflows {str(dtype).removeprefix('torch.')}, the dtype "
                             f"the edit is applied in (largest {torch.finfo(dtype).max:.3g}); use a smaller alpha")
        return vector

    def bind(self, lens: AttachedModel) -> None:
        if self.scale in MEASURED and not self._fixed_norm:
            from conceptlens.steering import units

            self.norm = getattr(units, self.scale)(lens, self.site)
        dtype = next((p.dtype for p in lens.model.parameters() if p.is_floating_point()), torch.float32)
        self._vector = self._scaled(dtype if dtype.is_floating_point else torch.float32)

    def at(self, alpha: float) -> Add:
        """A copy of this edit with strength `alpha` (same direction, scale, and measured norm)."""
        new = copy.copy(self)
        new.alpha = _number("alpha", alpha)
        new._vector = None if self.scale in MEASURED and self.norm is None else new._scaled()
        return new

    @property
    def vector(self) -> Tensor:
        """(d,) what is added to each edited token."""
        if self._vector is None:
            raise RuntimeError(f"Add(scale={self.scale!r}) learns the site's token norm when a steering scope is built "
                               "(lens.steer(add)); pass norm= to use it without a lens")
        return self._vector

    def apply(self, x: Tensor, mask: Tensor | None) -> Tensor:
        return add_vector(x, self.vector, mask)


def add_vector(x: Tensor, vector: Tensor, mask: Tensor | None) -> Tensor:
    v = vector.to(device=x.device, dtype=x.dtype)
    return x + v if mask is None else x + mask[..., None].to(x.dtype) * v


class ProjectOut(Edit):
    """Remove the span of the directions: x - Q^T Q x with Q an orthonormal basis of it."""

    @known_kwargs
    def __init__(self, concepts: Concepts, *, site: str | None = None) -> None:
        self.site = _site_of(concepts, site)
        directions = _directions(concepts).double()
        if not len(directions) or not directions.any():
            raise ValueError(f"ProjectOut needs at least one nonzero direction; got {len(directions)} "
                             f"direction{'' if len(directions) == 1 else 's'}, none nonzero")
        # SVD, not QR: the span is right whichever directions are dependent or repeated.
        _, s, vh = torch.linalg.svd(directions, full_matrices=False)
        self.basis = vh[s > 1e-10 * s.max()].float().contiguous()  # (rank, d) orthonormal rows
        self.width, self.model = directions.shape[1], getattr(concepts, "model", None)

    def apply(self, x: Tensor, mask: Tensor | None) -> Tensor:
        basis = self.basis.to(x.device)
        xf = x.float()  # in bf16 the projection would leave ~1e-2 of the component
        new = (xf - (xf @ basis.T) @ basis).to(x.dtype)
        return self._select(x, new, mask)


class Clamp(Edit):
    """Set one SAE latent to `value`, keeping the SAE's reconstruction error:
    x' = x + decode(z') - decode(z), so a latent left at its value changes nothing."""

    @known_kwargs
    def __init__(self, sae: Any, latent: int | Sequence[int], value: float, *, site: str | None = None) -> None:
        if not (callable(getattr(sae, "encode", None)) and callable(getattr(sae, "decode", None))):
            raise TypeError(f"Clamp needs an SAE with encode() and decode(); got {type(sae).__name__}")
        self.site = _site_of(sae, site)
        self.sae = sae
        self.latents = _indices("latent", latent)
        self.value = _number("value", value)
        self.width = getattr(sae, "d", None)
        n = getattr(getattr(sae, "config", None), "width", None)
        if isinstance(n, int) and not bool(((self.latents >= -n) & (self.latents < n)).all()):
            raise ValueError(f"latent {latent!r} is out of range: the SAE has {n} latents (0-{n - 1})")

    @torch.no_grad()
    def apply(self, x: Tensor, mask: Tensor | None) -> Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        z = self.sae.encode(flat)
        z_new = z.clone()
        z_new[:, self.latents.to(z.device)] = self.value
        delta = self.sae.decode(z_new) - self.sae.decode(z)  # on the SAE's device
        new = x + delta.reshape(x.shape).to(device=x.device, dtype=x.dtype)
        return self._select(x, new, mask)


class CodeAblate(Edit):
    """Subtract the assigned code's vector from tokens assigned to one of `codes`."""

    @known_kwargs
    def __init__(self, codebook: Any, codes: int | Sequence[int], *, site: str | None = None) -> None:
        if not (callable(getattr(codebook, "assign", None)) and callable(getattr(codebook, "quantize", None))):
            raise TypeError(f"CodeAblate needs a codebook with assign() and quantize(); got {type(codebook).__name__}")
        self.site = _site_of(codebook, site)
        self.codebook = codebook
        self.codes = _indices("codes", codes)
        self.width = getattr(codebook, "d", None)

    @torch.no_grad()
    def apply(self, x: Tensor, mask: Tensor | None) -> Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        assigned, codes = self.codebook.assign(flat), self.codebook.quantize(flat)  # codebook's device
        hit = torch.isin(assigned, self.codes.to(assigned.device))  # (B*T,)
        delta = torch.where(hit[:, None], -codes, torch.zeros_like(codes))
        new = x + delta.reshape(x.shape).to(device=x.device, dtype=x.dtype)
        return self._select(x, new, mask)
