"""Contrastive steering vectors from paired prompts, at one or several sites at once.

    vec = train_vector(lens, ["I love it", ...], ["I hate it", ...],
                       sites=["blocks.10.resid_out", "blocks.12.resid_out"], method="mean_diff")
    with lens.steer(*vec.edits(alpha=4.0)):          # every site in one scope
        model.generate(**inputs)

For each pair, the activation of the last real token of each prompt is read at every site
(one capture-only forward per batch); the vector is the mean of the differences
positive - negative (`"mean_diff"`, as steering-vectors does) or their first principal
direction, oriented so the positive prompts project higher and scaled to the mean
difference's projection on it (`"pca"`, as repeng's pca_diff, without centring). A
`SteeringVector` is a mapping site -> one-direction ConceptSet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Literal, Mapping, Sequence

import torch
from torch import Tensor

from conceptlens.batching import encode_batch
from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.devices import input_device
from conceptlens.interface import AttachedModel
from conceptlens.steering.edits import Add, Edit, Scale

Method = Literal["mean_diff", "pca"]
METHODS = ("mean_diff", "pca")


@dataclass
class SteeringVector(Mapping[str, ConceptSet]):
    """One direction per site, trained together; `edits(alpha)` steers all of them in one scope."""

    vectors: dict[str, ConceptSet] = field(default_factory=dict)

    def __getitem__(self, site: str) -> ConceptSet:
        return self.vectors[site]

    def __iter__(self) -> Iterator[str]:
        return iter(self.vectors)

    def __len__(self) -> int:
        return len(self.vectors)

    def edits(self, alpha: float = 1.0, *, scale: Scale = "raw", keep_norm: bool = False) -> list[Edit]:
        """One edit per site: `Add(v, alpha, scale=scale)` (`scale="robust_norm"`: alpha in the
        unit of the CLI's concept steering), or `AddKeepNorm` (same direction, each edited token
        rescaled to its original norm) with `keep_norm=True`."""
        cls = AddKeepNorm if keep_norm else Add
        return [cls(cs, alpha, scale=scale) for cs in self.vectors.values()]


class AddKeepNorm(Add):
    """x' = (x + alpha v) * |x| / |x + alpha v|: the direction changes, each token's norm does not.
    Built as `Add` is (same scales, summed vector and `at`); never summed with other Adds."""

    def apply(self, x: Tensor, mask: Tensor | None) -> Tensor:
        xf = x.float()
        moved = xf + self.vector.to(xf.device)
        new = (moved * (xf.norm(dim=-1, keepdim=True) / moved.norm(dim=-1, keepdim=True).clamp_min(1e-12)))
        return self._select(x, new.to(x.dtype), mask)


def train_vector(lens: AttachedModel, positive: Sequence[str], negative: Sequence[str], *, sites: str | Sequence[str],
                 method: Method = "mean_diff", batch_size: int = 16, max_length: int = 256,
                 tokenizer=None) -> SteeringVector:
    """A steering vector per site from paired prompts (`positive[i]` pairs with `negative[i]`)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    if isinstance(positive, str) or isinstance(negative, str):
        raise TypeError("positive and negative are sequences of prompts, not single strings")
    if len(positive) != len(negative) or not positive:
        raise ValueError(f"need the same positive number of positive and negative prompts; "
                         f"got {len(positive)} and {len(negative)}")
    tokenizer = tokenizer or lens.tokenizer
    if tokenizer is None:
        raise ValueError("train_vector needs a tokenizer: conceptlens.attach(model, tokenizer)")
    names = [lens.site(s).name for s in ([sites] if isinstance(sites, str) else sites)]
    pos = last_token_acts(lens, tokenizer, list(positive), names, batch_size, max_length)
    neg = last_token_acts(lens, tokenizer, list(negative), names, batch_size, max_length)
    out = {}
    for site in names:
        diffs = pos[site] - neg[site]  # (P, d)
        direction = diffs.mean(0) if method == "mean_diff" else _principal(diffs)
        config = {"method": method, "pairs": len(positive), "read": "last_token"}
        out[site] = ConceptSet(direction, site, method=f"contrastive-{method}", config=config,
                               model=lens.name)
    return SteeringVector(out)


def _principal(diffs: Tensor) -> Tensor:
    """First right singular vector of the (uncentred) differences, oriented along their mean
    and scaled to the mean difference's length along it."""
    _, _, vh = torch.linalg.svd(diffs.double(), full_matrices=False)
    v = vh[0]
    mean = diffs.double().mean(0)
    projection = mean @ v
    if projection < 0:
        v, projection = -v, -projection
    return (v * projection).float()


@torch.no_grad()
def last_token_acts(lens: AttachedModel, tokenizer, texts: list[str], sites: list[str], batch_size: int,
                    max_length: int) -> dict[str, Tensor]:
    """site -> (len(texts), d) activations of each text's last real token."""
    device = input_device(lens.model)
    rows: dict[str, list[Tensor]] = {s: [] for s in sites}
    with lens.capture(sites, keep_shape=True) as cap:
        for start in range(0, len(texts), batch_size):
            batch = encode_batch(tokenizer, texts[start:start + batch_size], max_length)
            if (batch["attention_mask"].sum(-1) == 0).any():
                raise ValueError("an empty prompt has no last token; every prompt needs at least one token")
            acts, _ = cap.forward(**{k: v.to(device) for k, v in batch.items()})
            last = batch["attention_mask"].sum(-1) - 1  # right-padded: index of the last real token
            for s in sites:
                x = acts[s]
                x = x.reshape(*x.shape[:2], -1)  # q/k/v heads concatenated
                rows[s].append(x[torch.arange(x.shape[0]), last.to(x.device)].float().cpu())
    return {s: torch.cat(r) for s, r in rows.items()}
