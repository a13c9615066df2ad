"""The unit of steering strength: a site's typical token norm, measured once per lens and site.

    robust_norm(lens, "blocks.15.resid_out")     # 115 on SmolLM2-135M, ~1,080 at block 9 of Gemma-3-270m
    Add(cs.centred()[12], alpha=0.5, scale="robust_norm")   # adds half a typical token's norm
    site_norm(lens, "blocks.15.resid_out")       # 174 on SmolLM2-135M, ~6,650 on Gemma-3-270m

Both are medians of the site's token norms (heads concatenated on q/k/v sites) over
`PROBE_TEXT` (or, for a lens without a tokenizer, `PROBE_TOKENS` fixed token ids), leaving
out each sequence's first position: the attention sink, whose norm can be 100x the others
(see `conceptlens.filters`). `site_norm` is the plain L2 norm; `robust_norm` leaves out the
site's massive coordinates (RMS over the probe above `MASSIVE` times the median coordinate's):
a model's norms and downstream layers rescale them away, so a unit that counts them steers
far harder on a model that has them (Gemma-3's block 9: one coordinate carries 90% of the
squared norm; the same alpha in site norms moves the next-token distribution 8-20x more than
on SmolLM2). The same text on every model makes the same alpha mean the same thing on
models whose activation scales differ by 40x.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
from torch import Tensor

from conceptlens.devices import input_device
from conceptlens.interface import AttachedModel

PROBE_TEXT = (
    "The committee met on Tuesday to discuss the new budget for the city's schools and parks.",
    "She opened the window, looked at the rain, and decided to stay at home with a book.",
    "Prices of wheat and coffee rose sharply after the storm damaged crops across the region.",
    "In the second half the visiting team scored twice and held on to win the match.",
)
"""Four plain sentences (news, narrative, economy, sport): about 80 tokens on a BPE tokenizer."""
PROBE_TOKENS = 64
"""Token ids per row when the lens has no tokenizer: 4 rows drawn with seed 0 from the vocabulary."""


MASSIVE = 10.0
"""A coordinate is massive when its RMS over the probe tokens exceeds this times the median RMS of the
coordinates (those never nonzero left out)."""
DOMINANT = 0.5
"""Warn when one coordinate carries more than this share of the site's summed squared token norm."""


class SiteScale(NamedTuple):
    """What the probe text measured at one site."""

    norm: float
    """Median token norm (`site_norm`)."""
    robust_norm: float
    """Median token norm over the coordinates that are not massive (`robust_norm`)."""
    massive: tuple[int, ...]
    """The coordinates left out of `robust_norm`, largest first."""
    top_share: float
    """Share of the summed squared token norm carried by the largest coordinate."""
    acts: Tensor
    """(N, d) float32 probe activations (first positions left out), for checks of an edit's span."""


def site_norm(lens: AttachedModel, site: str) -> float:
    """Median token norm at `site` over the probe text, measured on first use and cached on the lens."""
    return site_scale(lens, site).norm


def robust_norm(lens: AttachedModel, site: str) -> float:
    """Median token norm at `site` over the probe text without the site's massive coordinates."""
    return site_scale(lens, site).robust_norm


def site_scale(lens: AttachedModel, site: str) -> SiteScale:
    """The probe text's measurements at `site`, cached by the lens's hook manager; warns once when one
    coordinate dominates the site's norm."""
    name = lens.site(site).name
    cache = lens.hooks.site_norms
    if name not in cache:
        cache[name] = scale_of(_measure(lens, name))
        if cache[name].top_share > DOMINANT:
            top = cache[name]
            coordinate = int(top.acts.square().mean(0).argmax())
            warnings.warn(f"{name}: coordinate {coordinate} carries {top.top_share:.0%} of the squared token "
                          f"norm (a massive activation); scale='site_norm' counts it ({top.norm:.4g}), "
                          f"scale='robust_norm' leaves it out ({top.robust_norm:.4g})", UserWarning, stacklevel=3)
    return cache[name]


def scale_of(acts: Tensor) -> SiteScale:
    """The SiteScale of `(N, d)` token activations."""
    x = acts.double()
    square = x.square().mean(0)  # (d,) mean square of each coordinate
    typical = square[square > 0].median() if (square > 0).any() else square.new_tensor(0.0)  # dead ones aside
    massive = (square > MASSIVE ** 2 * typical).nonzero().flatten()
    massive = massive[square[massive].argsort(descending=True)]
    keep = torch.ones(x.shape[1], dtype=torch.bool)
    keep[massive] = False
    top = float(square.max() / square.sum()) if square.sum() > 0 else 0.0
    return SiteScale(float(x.norm(dim=1).median()), float(x[:, keep].norm(dim=1).median()),
                     tuple(massive.tolist()), top, acts.float())


def probe_ready(lens: AttachedModel) -> bool:
    """Whether the lens can run the probe: it has a tokenizer or a model config with vocab_size."""
    return lens.tokenizer is not None or _vocab(lens) >= 4


def _vocab(lens: AttachedModel) -> int:
    return int(getattr(lens.model.config, "vocab_size", 0) or 0)


def _probe_batch(lens: AttachedModel) -> dict[str, torch.Tensor]:
    from conceptlens.batching import pad_right

    tok = lens.tokenizer
    if tok is not None:
        ids = [tok(text)["input_ids"] for text in PROBE_TEXT]
    else:
        vocab = _vocab(lens)
        if vocab < 4:
            raise ValueError("site_norm needs a tokenizer or a model config with vocab_size; "
                             "attach(model, tokenizer) or pass norm= to Add")
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, vocab, (len(PROBE_TEXT), PROBE_TOKENS), generator=g).tolist()
    return pad_right(ids)


@torch.no_grad()
def _measure(lens: AttachedModel, name: str) -> Tensor:
    batch = _probe_batch(lens)
    model = lens.model
    device = input_device(model)
    if getattr(model.config, "is_encoder_decoder", False):  # the decoder reads the probe text too, padding masked
        batch["decoder_input_ids"], batch["decoder_attention_mask"] = batch["input_ids"], batch["attention_mask"]
    with lens.capture(name) as capture, lens.hooks.private_forward(capture):  # the unsteered model, whatever is open
        acts, meta = capture.forward(**{k: v.to(device) for k, v in batch.items()})
    x = acts[name]
    rows = x.flatten(1)[(meta.position > 0).to(x.device)].float().cpu()  # (N, d)
    if not len(rows):
        raise ValueError(f"the probe text left no token at {name} after the first position")
    return rows
