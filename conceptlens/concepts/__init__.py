"""Online concept extractors and ConceptSet: tensors in, tensors out."""

from conceptlens.concepts.base import Extractor
from conceptlens.concepts.conceptset import ConceptSet

__all__ = ["Extractor", "ConceptSet"]
