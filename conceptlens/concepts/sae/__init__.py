"""Sparse autoencoders trained online on streamed activations.

    sae = TopKSAE(width=4608, k=32, seed=0)
    for x in stream: sae.update(x)
    cs = sae.concept_set()
    sae.trainer                 # its SAETrainer: buffer, warm-up, Adam, statistics
"""

from conceptlens.concepts.sae.base import Code, SparseAutoencoder
from conceptlens.concepts.sae.batchtopk import BatchTopKConfig, BatchTopKSAE
from conceptlens.concepts.sae.clt import CLTConfig, CrossLayerTranscoder
from conceptlens.concepts.sae.crosscoder import (Crosscoder, CrosscoderConfig, ReLUCrosscoder, ReLUCrosscoderConfig,
                                                 split_concept_set)
from conceptlens.concepts.sae.config import SAEConfig
from conceptlens.concepts.sae.jumprelu import JumpReLUConfig, JumpReLUSAE
from conceptlens.concepts.sae.hsae import HSAE, HSAEConfig
from conceptlens.concepts.sae.matryoshka import ArchMSAE, MatryoshkaConfig, MatryoshkaSAE
from conceptlens.concepts.sae.mpsae import MPConfig, MPSAE
from conceptlens.concepts.sae.multisite_io import multisite_from_concept_set
from conceptlens.concepts.sae.persist import SAEState, TrainerState
from conceptlens.concepts.sae.nested import ActMSAE, ActMSAEConfig, EWGConfig, EWGSAE
from conceptlens.concepts.sae.relu import ReLUConfig, ReLUSAE
from conceptlens.concepts.sae.restore import sae_from_concept_set
from conceptlens.concepts.sae.saelens import export_saelens, import_saelens
from conceptlens.concepts.sae.spade import SpaDE, SpaDEConfig
from conceptlens.concepts.sae.sparsemax import sparsemax
from conceptlens.concepts.sae.stats import SAEStats, StepStats
from conceptlens.concepts.sae.topk import TopKConfig, TopKSAE
from conceptlens.concepts.sae.trainer import SAETrainer
from conceptlens.concepts.sae.transcoder import SkipTranscoder, Transcoder, TranscoderConfig
from conceptlens.concepts.sae.transcoder_io import export_transcoder, import_transcoder, transcoder_from_concept_set

__all__ = [
    "SparseAutoencoder", "SAEConfig", "Code", "SAEStats", "StepStats", "SAETrainer", "SAEState", "TrainerState",
    "ReLUSAE", "ReLUConfig", "TopKSAE", "TopKConfig", "BatchTopKSAE", "BatchTopKConfig",
    "JumpReLUSAE", "JumpReLUConfig", "SpaDE", "SpaDEConfig", "MatryoshkaSAE", "MatryoshkaConfig", "ArchMSAE",
    "ActMSAE", "ActMSAEConfig", "EWGSAE", "EWGConfig", "MPSAE", "MPConfig", "HSAE", "HSAEConfig",
    "sparsemax", "export_saelens", "import_saelens", "sae_from_concept_set",
    "Transcoder", "SkipTranscoder", "TranscoderConfig", "export_transcoder", "import_transcoder",
    "transcoder_from_concept_set", "Crosscoder", "CrosscoderConfig", "ReLUCrosscoder", "ReLUCrosscoderConfig",
    "CrossLayerTranscoder", "CLTConfig", "split_concept_set", "multisite_from_concept_set",
]
