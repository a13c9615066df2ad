"""Feed a conceptlens extractor from inside an nnsight trace, on a local model (offline).

    python examples/nnsight_trace.py            # SmolLM2-135M, a few BBC News articles

Two ways, same rows: (1) read a layer's output with nnsight inside `with model.trace(...)`
and call `extractor.update` right there; (2) attach conceptlens to the nnsight wrapper and
open `lens.capture` around the trace, so the capture's hooks feed the extractor while
nnsight runs its own interventions. Padding and the attention-sink first token are dropped.
"""

from __future__ import annotations

import argparse

import torch

import conceptlens
from conceptlens.concepts.kmeans import StreamingKMeans


def rows_to_keep(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) mask -> (B, T) bool: real tokens, not the first one of each sequence."""
    position = attention_mask.long().cumsum(-1) - 1
    return attention_mask.bool() & (position > 0)


def fit_in_trace(wrapper, batches, layer: int, extractor) -> None:
    """(1) nnsight reads `model.layers[layer]`'s output; the extractor is fed inside the trace."""
    for batch in batches:
        keep = rows_to_keep(batch["attention_mask"])
        with wrapper.trace(**batch):
            hidden = wrapper.model.layers[layer].output  # (B, T, d), a real tensor inside the trace
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
            extractor.update(hidden[keep].float())


def fit_with_capture(wrapper, batches, layer: int, extractor) -> None:
    """(2) conceptlens hooks the wrapped module; nnsight's trace runs the forward."""
    lens = conceptlens.attach(wrapper)
    site = f"blocks.{layer}.resid_out"  # the output of model.layers[layer]

    def on_batch(acts, meta):
        extractor.update(acts[site][meta.position > 0])

    with lens.capture(site, on_batch=on_batch):
        for batch in batches:
            with wrapper.trace(**batch):
                pass  # nnsight interventions would go here


def main(n_docs: int = 16, layer: int = 15, k: int = 8) -> tuple[StreamingKMeans, StreamingKMeans]:
    from nnsight import LanguageModel

    from conceptlens import data, models

    model, tok = models.load("smollm2-135m")
    wrapper = LanguageModel(model, tokenizer=tok)
    texts = data.load("bbc-news", split="all").texts[:n_docs]
    batches = [dict(tok(texts[i:i + 4], return_tensors="pt", padding=True, truncation=True, max_length=64))
               for i in range(0, len(texts), 4)]
    a, b = StreamingKMeans(n_concepts=k, seed=0), StreamingKMeans(n_concepts=k, seed=0)
    fit_in_trace(wrapper, batches, layer, a)
    fit_with_capture(wrapper, batches, layer, b)
    a.flush(), b.flush()
    print("centres equal:", torch.equal(a.concept_set().directions, b.concept_set().directions))
    return a, b


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--layer", type=int, default=15)
    args = parser.parse_args()
    main(args.docs, args.layer)
