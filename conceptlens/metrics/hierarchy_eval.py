"""The hierarchy scores of Grandien et al. (2026), on evaluation samples with an independent embedding.

    dag = build_dag(stats)                               # conceptlens.metrics.hierarchy
    scores = hierarchy_scores(dag, z, e)                 # z: (N, width) codes, e: (N, E) embeddings
    scores.s_m, scores.s_ha, scores.depth, scores.per_edge["s_ai"]

Definitions (SPECS.md, 002; sim = cosine, e(x) an embedding of the input that the SAE did not
see, e.g. MiniLM sentence embeddings of the context):
- s_m(f) = sum_{i != j} a~_f(x_i) a~_f(x_j) sim(e_i, e_j) / sum_{i != j} a~_f(x_i) a~_f(x_j), with
  a~ the activation min-max normalised over the samples (monosemanticity; the released code sums
  over pairs i < j, which gives the same ratio).
- s_ha(p, c) = 1[s_m(p) < s_m(c)]; s_ss(p) = mean pairwise cosine of the children's
  activation-weighted mean embeddings (parents with >= 2 children).
- s_ai(p, c) = P[A_p | A_c]; s_ad(p, c) = P[a_p >= a_c | A_p, A_c];
  s_rf(p) = P[some child fires | A_p]; s_cc(p) = Spearman(a_p, max_c a_c) over the samples where
  some child fires.
A (firing) and a (activation) are the graph's: a <- max(a, 0), zero outside each sample's top
`top` latents. s_m and s_ss use the activation max(a, 0) before the top-k cut. Model-level
figures are means over the DAG's nodes (s_m), edges (s_ha, s_ai, s_ad) or parents (s_ss, s_rf,
s_cc), ignoring nan (a conditional with fewer than `min_samples` samples).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import networkx as nx
import torch
from torch import Tensor

from conceptlens.metrics.hierarchy import dag_depth


def monosemanticity(z: Tensor, embeddings: Tensor) -> Tensor:
    """s_m of every latent, `(width,)` float64 (nan for a latent constant over the samples).

    Closed form of the pair sum: with S = a~^T e^ (e^ the unit embeddings),
    sum_{i != j} a~_i a~_j cos_ij = |S|^2 - sum_i a~_i^2 and the weights sum to (sum a~)^2 - sum a~^2.
    """
    if z.ndim != 2 or embeddings.ndim != 2 or z.shape[0] != embeddings.shape[0]:
        raise ValueError(f"z (N, width) and embeddings (N, E) need the same N; got {tuple(z.shape)} "
                         f"and {tuple(embeddings.shape)}")
    a = z.double().clamp_min(0)
    low, high = a.min(0).values, a.max(0).values
    span = high - low
    a = (a - low) / torch.where(span > 0, span, torch.ones_like(span))
    e = torch.nn.functional.normalize(embeddings.double(), dim=1)
    S = a.T @ e  # (width, E)
    sq = (a * a).sum(0)
    num = (S * S).sum(1) - sq
    den = a.sum(0) ** 2 - sq
    return torch.where((span > 0) & (den > 0), num / torch.where(den > 0, den, torch.ones_like(den)),
                       torch.full_like(den, math.nan))


def graph_activations(z: Tensor, top: int = 64) -> tuple[Tensor, Tensor]:
    """(a, A) as the graph protocol sees them: a = max(z, 0) kept only among each sample's top
    `top` latents, A = (a > 0). Both `(N, width)`; a float64, A bool."""
    a = z.double().clamp_min(0)
    keep = torch.zeros_like(a, dtype=torch.bool).scatter_(1, a.topk(min(top, a.shape[1]), dim=1).indices, True)
    a = a * keep
    return a, a > 0


def _prob(event: Tensor, given: Tensor, min_samples: int) -> float:
    n = int(given.sum())
    return float((event & given).sum()) / n if n >= max(min_samples, 1) else math.nan


def _spearman(x: Tensor, y: Tensor) -> float:
    from scipy.stats import spearmanr

    if x.numel() < 2 or bool((x == x[0]).all()) or bool((y == y[0]).all()):
        return math.nan
    return float(spearmanr(x.numpy(), y.numpy()).statistic)


def _sibling_similarity(children: list[int], raw: Tensor, e: Tensor) -> float:
    if len(children) < 2:
        return math.nan
    w = raw[:, children]  # (N, C)
    total = w.sum(0)
    if bool((total <= 0).any()):
        return math.nan
    centres = torch.nn.functional.normalize((w.T @ e) / total[:, None], dim=1)  # (C, E)
    sims = centres @ centres.T
    iu = torch.triu_indices(len(children), len(children), offset=1)
    return float(sims[iu[0], iu[1]].mean())


@dataclass
class HierarchyScores:
    """Graph size, depth and the paper's scores (model-level means; per-edge / per-parent values kept)."""

    nodes: int
    edges: int
    depth: int
    s_m: float
    s_ha: float
    s_ss: float
    s_ai: float
    s_ad: float
    s_rf: float
    s_cc: float
    per_edge: dict[str, dict[tuple[int, int], float]] = field(default_factory=dict)
    per_parent: dict[str, dict[int, float]] = field(default_factory=dict)
    s_m_per_node: dict[int, float] = field(default_factory=dict)

    def row(self) -> dict[str, float]:
        """The model-level figures, for a table."""
        return {k: getattr(self, k) for k in ("nodes", "edges", "depth", "s_m", "s_ha", "s_ss", "s_ai",
                                             "s_ad", "s_rf", "s_cc")}


def _nanmean(values: dict) -> float:
    kept = [v for v in values.values() if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def hierarchy_scores(dag: nx.DiGraph, z: Tensor, embeddings: Tensor, top: int = 64,
                     min_samples: int = 1) -> HierarchyScores:
    """The paper's scores for `dag` (latent indices) on evaluation codes `z` `(N, width)` and
    independent embeddings `(N, E)` of the same N inputs (see the module docstring)."""
    s_m_all = monosemanticity(z, embeddings)
    a, A = graph_activations(z, top)
    raw = z.double().clamp_min(0)
    e = torch.nn.functional.normalize(embeddings.double(), dim=1)
    edge: dict[str, dict[tuple[int, int], float]] = {"s_ha": {}, "s_ai": {}, "s_ad": {}}
    for p, c in dag.edges:
        sp, sc = float(s_m_all[p]), float(s_m_all[c])
        edge["s_ha"][p, c] = math.nan if math.isnan(sp) or math.isnan(sc) else float(sp < sc)
        edge["s_ai"][p, c] = _prob(A[:, p], A[:, c], min_samples)
        edge["s_ad"][p, c] = _prob(a[:, p] >= a[:, c], A[:, p] & A[:, c], min_samples)
    parent: dict[str, dict[int, float]] = {"s_ss": {}, "s_rf": {}, "s_cc": {}}
    for p in dag:
        children = sorted(dag.successors(p))
        if not children:
            continue
        any_child = A[:, children].any(1)
        parent["s_ss"][p] = _sibling_similarity(children, raw, e)
        parent["s_rf"][p] = _prob(any_child, A[:, p], min_samples)
        rows = any_child.nonzero().flatten()
        parent["s_cc"][p] = (_spearman(a[rows, p], a[rows][:, children].max(1).values)
                             if rows.numel() >= max(min_samples, 2) else math.nan)
    per_node = {n: float(s_m_all[n]) for n in dag}
    return HierarchyScores(
        nodes=dag.number_of_nodes(), edges=dag.number_of_edges(), depth=dag_depth(dag),
        s_m=_nanmean(per_node), s_ha=_nanmean(edge["s_ha"]), s_ss=_nanmean(parent["s_ss"]),
        s_ai=_nanmean(edge["s_ai"]), s_ad=_nanmean(edge["s_ad"]), s_rf=_nanmean(parent["s_rf"]),
        s_cc=_nanmean(parent["s_cc"]), per_edge=edge, per_parent=parent, s_m_per_node=per_node)
