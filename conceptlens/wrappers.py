"""Models that arrive wrapped by another library: take the transformers model out.

    lens = conceptlens.attach(nnsight.LanguageModel(model, tokenizer=tok))   # same as attach(model, tok)

An nnsight `NNsight` / `LanguageModel` (an `Envoy`) mirrors a module tree and keeps the real
module in `_module`; conceptlens hooks that module, so its captures and edits also run
inside `with wrapper.trace(...)` blocks, alongside nnsight's own interventions.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def unwrap(model: Any, tokenizer: Any = None) -> tuple[Any, Any]:
    """(model, tokenizer) with an nnsight wrapper replaced by the module it wraps (and its tokenizer)."""
    if type(model).__module__.split(".", 1)[0] == "nnsight":
        inner = model.__dict__.get("_module")  # not getattr: an Envoy resolves unknown names lazily
        if isinstance(inner, nn.Module):
            return inner, tokenizer if tokenizer is not None else model.__dict__.get("tokenizer")
    return model, tokenizer
