"""Metrics: gauge-invariant attention geometry, concept quality, hierarchy, faithfulness.

    from conceptlens.metrics import QueryKeyMoments, key_distance, gauge_audit, probe_loss, splice_ce, faithfulness

Names load lazily from their modules (gauge, gauge_audit, capture_qk, quality, hierarchy,
hierarchy_eval, splice, faithfulness), so importing this package pulls in neither networkx nor a model.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "gauge": ["QueryKeyMoments", "key_distance", "score_cosine", "qk_spectrum", "qk_singular_values",
              "key_cosine", "key_norm", "key_pca_explained"],
    "gauge_audit": ["AUDIT_METRICS", "AuditMetric", "gauge_audit", "AuditReport", "GaugeTransform", "random_gauge", "apply_gauge", "gauged"],
    "capture_qk": ["qk_capture", "QKCapture"],
    "quality": ["probe_loss", "standardised_probe_loss", "ProbeResult", "fit_logistic_1d", "mppc", "effective_rank",
                "max_pairwise_cosine",
                "fvu", "l0", "dead_fraction", "ce_loss_recovered", "lda_directions", "LDADirections",
                "best_latent_f1"],
    "hierarchy": ["CoactivationStats", "build_dag", "dag_depth", "export_dag"],
    "hierarchy_eval": ["hierarchy_scores", "HierarchyScores", "monosemanticity", "graph_activations"],
    "similarity": ["similarity", "group_audit", "GroupAuditReport", "MEASURES", "SimilarityMeasure", "linear_cka",
                   "cca", "svcca", "procrustes", "mutual_knn", "random_element"],
    "duality": ["ProbeWeight", "Direction", "InnerProduct", "probe_to_direction", "direction_to_probe"],
    "gauge_sites": ["GaugeWarning", "warn_if_qk", "is_qk_site"],
    "splice": ["splice_ce", "SpliceResult", "splice_mask"],
    "splice_sites": ["splice_replacement", "splice_crosscoder"],
    "faithfulness": ["faithfulness", "FaithfulnessResult", "ProbeTask", "next_token_loss_sum"],
    "controls": ["covariance_directions", "random_orthonormal", "base_rate_entropy", "majority_accuracy",
                 "unigram_entropy"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)

if TYPE_CHECKING:
    from conceptlens.metrics.capture_qk import QKCapture, qk_capture
    from conceptlens.metrics.gauge import (QueryKeyMoments, key_cosine, key_distance, key_norm, key_pca_explained,
                                           qk_singular_values, qk_spectrum, score_cosine)
    from conceptlens.metrics.gauge_audit import (AUDIT_METRICS, AuditMetric, AuditReport, GaugeTransform, apply_gauge,
                                                 gauge_audit, gauged, random_gauge)
    from conceptlens.metrics.hierarchy import CoactivationStats, build_dag, dag_depth, export_dag
    from conceptlens.metrics.hierarchy_eval import (HierarchyScores, graph_activations, hierarchy_scores,
                                                    monosemanticity)
    from conceptlens.metrics.quality import (LDADirections, ProbeResult, best_latent_f1, ce_loss_recovered,
                                             dead_fraction, effective_rank, fit_logistic_1d, fvu, l0, lda_directions,
                                             max_pairwise_cosine, mppc, probe_loss, standardised_probe_loss)
    from conceptlens.metrics.faithfulness import FaithfulnessResult, ProbeTask, faithfulness, next_token_loss_sum
    from conceptlens.metrics.duality import (Direction, InnerProduct, ProbeWeight, direction_to_probe,
                                             probe_to_direction)
    from conceptlens.metrics.gauge_sites import GaugeWarning, is_qk_site, warn_if_qk
    from conceptlens.metrics.similarity import (MEASURES, GroupAuditReport, SimilarityMeasure, cca, group_audit,
                                                linear_cka, mutual_knn, procrustes, random_element, similarity,
                                                svcca)
    from conceptlens.metrics.splice import SpliceResult, splice_ce, splice_mask
    from conceptlens.metrics.splice_sites import splice_crosscoder, splice_replacement
    from conceptlens.metrics.controls import (base_rate_entropy, covariance_directions, majority_accuracy,
                                              random_orthonormal, unigram_entropy)


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f"conceptlens.metrics.{_MODULE_OF[name]}"), name)
    raise AttributeError(f"module 'conceptlens.metrics' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """Keeps a function named like its module (`gauge_audit`, `faithfulness`) the package
    attribute: importing the submodule would otherwise set `metrics.gauge_audit` to the module,
    so `from conceptlens.metrics import gauge_audit` returned the module. Submodules stay
    importable as `from conceptlens.metrics.gauge_audit import ...` (through sys.modules)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in _MODULE_OF and _MODULE_OF[name] == name:
            return  # the import system registering the submodule: the function keeps the name
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
