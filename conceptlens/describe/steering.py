"""Steering samples of the description pass: chosen concepts swept over alpha, the largest fluent one named.

    SteeringRequest(["kmeans:12", "topk:5"])        # or {"kmeans": [12], "topk": [5]}
    lens.describe(sets, data, steering=request)     # info["steering"] of each set's Description

Each chosen concept is a `steering.sweep` of `Add(direction, alpha, scale="robust_norm")` (the
direction centred when the set carries the fit's mean, as the CLI's `steer` does) at every
position: a few prompts continued greedily at each alpha, scored by how far the unsteered model
reading the text finds it along the concept (`ConceptExpression`) and by its perplexity under
the unsteered model; `chosen_alpha` is the largest alpha within the fluency budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.interface import AttachedModel

if TYPE_CHECKING:
    from torch import Tensor

    from conceptlens.steering.sweep import SweepResult


@dataclass
class SteeringRequest:
    """Steering samples to record: a few prompts continued unsteered and steered, per alpha."""

    concepts: Sequence[str] | Mapping[str, Sequence[int]]
    """Concepts named `set:index` (e.g. ["kmeans:12", "topk:5"]), or indices per set name."""
    prompts: Sequence[str] = ("I went to the shop and", "The weather today is", "Yesterday the committee decided to")
    alphas: Sequence[float] = (0.0, 0.25, 0.5, 1.0, 2.0)
    """Multiples of the site's robust token norm (`steering.units.robust_norm`, the unit of
    `Add(..., scale="robust_norm")`) added along the unit direction."""
    max_new_tokens: int = 24
    budget: float = 2.0
    """Fluency budget: the most median perplexity, in multiples of the unsteered continuations'."""

    def chosen(self, sets: Mapping[str, int]) -> dict[str, list[int]]:
        """set name -> concept indices, checked against `sets` (name -> number of concepts)."""
        if isinstance(self.concepts, Mapping):
            chosen = {name: [int(i) for i in indices] for name, indices in self.concepts.items()}
        else:
            chosen = {}
            for name, index in (_named(item) for item in self.concepts):
                chosen.setdefault(name, []).append(index)
        for name, indices in chosen.items():
            if name not in sets:
                raise ValueError(f"steering samples for set {name!r}, which is not described here; the sets are "
                                 f"{sorted(sets)}")
            bad = [i for i in indices if not 0 <= i < sets[name]]
            if bad:
                raise ValueError(f"steering concept {name}:{bad[0]} is out of range: {name!r} has {sets[name]} "
                                 f"concepts (0-{sets[name] - 1})")
        return chosen


def _named(item: Any) -> tuple[str, int]:
    """'kmeans:12' -> ('kmeans', 12)."""
    name, sep, index = str(item).rpartition(":")
    if not (sep and name and index.strip().isdigit()):
        raise ValueError(f"steering concept {item!r} is not SET:INDEX (e.g. 'kmeans:12')")
    return name.strip(), int(index)


def steering_samples(lens: AttachedModel, tokenizer: Any, concepts: ConceptSet, name: str, indices: Sequence[int],
                     request: SteeringRequest) -> list[dict[str, Any]]:
    """For each concept of `indices`: its sweep over `request.alphas` as JSON-ready samples."""
    from conceptlens.steering import Add, sweep
    from conceptlens.steering.sweep_scores import ConceptExpression
    from conceptlens.steering.units import robust_norm

    if not indices or not getattr(lens.model, "can_generate", lambda: False)():
        return []
    site = concepts.site
    if site is None:
        raise ValueError(f"steering samples of {name!r} need the site its concepts live at; the set names none")
    directions = (concepts.centred() if concepts.mean is not None else concepts).directions
    norm = robust_norm(lens, site)
    prompts = list(request.prompts)
    groups = [prompts] if getattr(tokenizer, "pad_token_id", None) is not None else [[p] for p in prompts]
    samples = []
    for index in indices:
        direction = directions[int(index)]
        score = ConceptExpression(lens, direction, site, mean=concepts.mean)
        edit = Add(direction, 1.0, scale="robust_norm", norm=norm, site=site)
        result = _joined([sweep(lens, edit, request.alphas, group, score, positions="all",
                                max_new_tokens=request.max_new_tokens, tokenizer=tokenizer,
                                budget=request.budget) for group in groups])
        samples.append(_record(result, f"{name}:{int(index)}", int(index), prompts, norm))
    return samples


def _joined(results: list[SweepResult]) -> SweepResult:
    """One result whose prompts are those of `results` side by side (a tokenizer without a pad
    token sweeps one prompt at a time)."""
    import torch

    if len(results) == 1:
        return results[0]
    first = results[0]
    return first._replace(scores=torch.cat([r.scores for r in results], 1),
                          texts=[sum((r.texts[a] for r in results), []) for a in range(len(first.alphas))],
                          perplexity=_cat([r.perplexity for r in results], 1),
                          reference=_cat([r.reference for r in results], 0))


def _cat(parts: list[Tensor | None], dim: int) -> Tensor | None:
    """The parts side by side; None where a sweep measured no fluency."""
    import torch

    tensors = [p for p in parts if p is not None]
    return torch.cat(tensors, dim) if len(tensors) == len(parts) else None


def _record(result: SweepResult, label: str, index: int, prompts: list[str], norm: float) -> dict[str, Any]:
    ppl, fluent, reference = result.median_perplexity, result.fluent, result.reference
    if ppl is None or fluent is None or reference is None:
        raise ValueError("steering samples need sweeps that measure fluency (fluency=True)")
    runs = [{"alpha": alpha, "scale": "robust_norm", "text": texts[0], "texts": texts, "score": _finite(mean),
             "perplexity": _finite(ppl[a]), "fluent": fluent[a]}
            for a, (alpha, texts, mean) in enumerate(zip(result.alphas, result.texts, result.mean.tolist()))]
    return {"concept": index, "name": label, "prompt": prompts[0], "prompts": prompts, "scale": "robust_norm",
            "positions": "all",
            "norm": norm, "score": result.label, "budget": result.budget,
            "reference_perplexity": _finite(reference.nanquantile(0.5)),
            "chosen_alpha": result.best_alpha, "samples": runs}


def _finite(value: Any) -> float | None:
    """A float, or None for nan (JSON has no NaN)."""
    value = float(value)
    return value if math.isfinite(value) else None
