"""Online concept extractors and ConceptSet: tensors in, tensors out.

    from conceptlens.concepts import StreamingKMeans, Deleuzian, TopKSAE, VQCodebook
"""

from conceptlens.concepts.base import Extractor, ExtractorBase, NotFittedError
from conceptlens.concepts.buffer import MixingBuffer
from conceptlens.concepts.clvq import CLVQConfig, CLVQTranscoder
from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.concepts.deleuzian import Deleuzian, DeleuzianConfig
from conceptlens.concepts.kmeans import KMeansConfig, StreamingKMeans
from conceptlens.concepts.sae import (
    HSAE,
    MPSAE,
    ActMSAE,
    ArchMSAE,
    BatchTopKSAE,
    EWGSAE,
    JumpReLUSAE,
    MatryoshkaSAE,
    ReLUSAE,
    SAEConfig,
    SpaDE,
    SparseAutoencoder,
    TopKSAE,
    export_saelens,
    import_saelens,
)
from conceptlens.concepts.sae.sharded import ShardedTopKSAE
from conceptlens.concepts.sharded import ShardedKMeans
from conceptlens.concepts.vq import VQCodebook, VQConfig
from conceptlens.concepts.vq_sharded import ShardedVQ

__all__ = [
    "Extractor", "ExtractorBase", "NotFittedError", "ConceptSet", "MixingBuffer",
    "StreamingKMeans", "KMeansConfig", "Deleuzian", "DeleuzianConfig",
    "SparseAutoencoder", "SAEConfig", "ReLUSAE", "TopKSAE", "BatchTopKSAE", "JumpReLUSAE", "SpaDE",
    "MatryoshkaSAE", "ArchMSAE", "ActMSAE", "EWGSAE", "MPSAE", "HSAE", "export_saelens", "import_saelens",
    "VQCodebook", "VQConfig", "CLVQTranscoder", "CLVQConfig", "ShardedKMeans", "ShardedTopKSAE",
    "ShardedVQ",
]
