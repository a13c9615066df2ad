"""conceptlens: wrap a Hugging Face transformer in one line, stream its activations into
online concept extractors, and put concepts back in as steering or ablation edits.

    import conceptlens
    lens = conceptlens.attach(model)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["attach", "Lens", "ConceptSet", "__version__"]

if TYPE_CHECKING:
    from conceptlens.concepts.conceptset import ConceptSet
    from conceptlens.lens import Lens, attach

_LAZY = {"attach": "conceptlens.lens", "Lens": "conceptlens.lens",
         "ConceptSet": "conceptlens.concepts.conceptset"}
_SUBMODULES = {"models", "data", "concepts", "steering", "metrics", "fit", "describe", "report"}


def __getattr__(name: str) -> Any:
    # Lazy re-exports and submodules: `import conceptlens` stays cheap (no transformers import).
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"conceptlens.{name}")
    raise AttributeError(f"module 'conceptlens' has no attribute {name!r}")


def __dir__() -> list[str]:
    # what `dir(conceptlens)` and tab completion show: the lazy names too, without importing them
    return sorted({*globals(), *_LAZY, *_SUBMODULES})
