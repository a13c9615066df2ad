"""The unit of steering strength: a site's typical token norm, measured once per lens and site.

    site_norm(lens, "blocks.15.resid_out")       # 173.6 on SmolLM2-135M, ~6,500 on Gemma-3-270m
    Add(cs.centred()[12], alpha=0.5, scale="site_norm")   # adds half a typical token's norm

The typical norm is the median L2 norm of the site's activations (heads concatenated on
q/k/v sites) over `PROBE_TEXT` (or, for a lens without a tokenizer, `PROBE_TOKENS` fixed
token ids), leaving out each sequence's first position: the attention sink, whose norm can be
100x the others (see `conceptlens.filters`). The same text on every model makes the same
alpha mean the same thing on models whose activation scales differ by 40x.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from conceptlens.lens import Lens

PROBE_TEXT = (
    "The committee met on Tuesday to discuss the new budget for the city's schools and parks.",
    "She opened the window, looked at the rain, and decided to stay at home with a book.",
    "Prices of wheat and coffee rose sharply after the storm damaged crops across the region.",
    "In the second half the visiting team scored twice and held on to win the match.",
)
"""Four plain sentences (news, narrative, economy, sport): about 80 tokens on a BPE tokenizer."""
PROBE_TOKENS = 64
"""Token ids per row when the lens has no tokenizer: 4 rows drawn with seed 0 from the vocabulary."""


def site_norm(lens: Lens, site: str) -> float:
    """Median token norm at `site` over the probe text, measured on first use and cached on the lens."""
    name = lens.site(site).name
    cache = lens.__dict__.setdefault("_site_norms", {})
    if name not in cache:
        cache[name] = _measure(lens, name)
    return cache[name]


def _probe_batch(lens: Lens) -> dict[str, torch.Tensor]:
    from conceptlens.batching import pad_right

    tok = lens.tokenizer
    if tok is not None:
        ids = [tok(text)["input_ids"] for text in PROBE_TEXT]
    else:
        vocab = int(getattr(lens.model.config, "vocab_size", 0) or 0)
        if vocab < 4:
            raise ValueError("site_norm needs a tokenizer or a model config with vocab_size; "
                             "attach(model, tokenizer) or pass norm= to Add")
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, vocab, (len(PROBE_TEXT), PROBE_TOKENS), generator=g).tolist()
    return pad_right(ids)


@torch.no_grad()
def _measure(lens: Lens, name: str) -> float:
    batch = _probe_batch(lens)
    model = lens.model
    device = next(model.parameters()).device
    if getattr(model.config, "is_encoder_decoder", False):
        batch["decoder_input_ids"] = batch["input_ids"]
    with lens.capture(name) as capture:
        acts = capture.forward(**{k: v.to(device) for k, v in batch.items()})[name]
    meta = capture.last[1]
    norms = acts.flatten(1).double().norm(dim=1)[(meta.position > 0).to(acts.device)]
    if not len(norms):
        raise ValueError(f"the probe text left no token at {name} after the first position")
    return float(norms.median())
