"""Concept hierarchies from co-activation: the graph protocol of Grandien et al. (2026).

    stats = CoactivationStats(width=4608)
    for z in stream:                      # z: (N, width) latent activations
        stats.update(z)
    dag = build_dag(stats)                # networkx.DiGraph, edges parent -> child
    dag_depth(dag)                        # the paper's "max depth"
    export_dag(dag, "run/hierarchy")      # .json, .graphml, .png

The protocol of "Do Sparse Autoencoders Learn Meaningful Concept Hierarchies?" (SPECS.md, 002;
checked against its released code, eval-HSAEs): binarise (a <- max(a, 0), keep each sample's top
`top` latents: A_i = 1 iff i is among them and a_i > 0), stream the weighted conditional
co-activation W[i, j] = sum_x a_i A_i A_j / sum_x a_i A_i (the paper's C_ji: the share of i's
activation mass that falls while j fires) and draw p -> c when W[c, p] > threshold and not
W[p, c] > threshold. The paper's scores (s_m, s_ha, s_ss, s_ai, s_ad, s_rf, s_cc) need the
evaluation samples and an independent embedding of them: `conceptlens.metrics.hierarchy_eval`.
"""

from __future__ import annotations

import os
from pathlib import Path
from dataclasses import dataclass
from typing import Any, NamedTuple

import networkx as nx
import torch
from torch import Tensor

from conceptlens._checks import check_int
from conceptlens.concepts.base import ExtractorBase

_PAIR_CHUNK = 1 << 22  # (sample, latent, latent) triples scattered per step: bounds memory


@dataclass
class CoactivationConfig:
    """Settings of `CoactivationStats`."""

    width: int
    """Number of latents."""
    top: int = 64
    """Latents kept per sample (its top activations)."""

    def __post_init__(self) -> None:
        check_int("width", self.width)
        check_int("top", self.top)


class CoactivationSummary(NamedTuple):
    rows: int
    """Samples summed."""
    alive_fraction: float
    """Fraction of latents that fired at least once."""


class CoactivationStats(ExtractorBase):
    """Streamed, mergeable co-activation sums of `width` latents (float64, exact to 2^53).

        stats = CoactivationStats(width=4608, top=64); stats.update(z); stats.W

    `merge` takes another worker's object or state dict; the sums add, so the result equals
    one run over both streams. Memory: two `(width, width)` float64 matrices (340 MB at width 4608).
    """

    Config = CoactivationConfig
    method = "coactivation"
    distributed = "merge"

    def __init__(self, width: int, top: int = 64, *, device: str | torch.device | None = None) -> None:
        self.config = CoactivationConfig(width, top)
        self._set_device(device)
        self.width, self.top = width, top
        self.n = 0
        dev = self.device or "cpu"
        self.count = torch.zeros(width, dtype=torch.float64, device=dev)  # sum B_i: firings
        self.mass = torch.zeros(width, dtype=torch.float64, device=dev)  # sum a_i B_i
        self.co_mass = torch.zeros(width, width, dtype=torch.float64, device=dev)  # [i, j] = sum a_i B_i B_j
        self.co_count = torch.zeros(width, width, dtype=torch.float64, device=dev)  # [i, j] = sum B_i B_j

    def update(self, z: Tensor) -> None:
        """Add activations `(N, width)` (any sign; negatives count as silent)."""
        if z.ndim != 2 or z.shape[1] != self.width:
            raise ValueError(f"z must have shape (N, {self.width}); got {tuple(z.shape)}")
        z = z.to(self.count.device)
        values, index = z.double().clamp_min(0).topk(min(self.top, self.width), dim=1)  # (N, k)
        values = values * (values > 0)  # B_i = 0 for silent latents among the top k
        fired = (values > 0).double()
        self.n += z.shape[0]
        self.count.index_add_(0, index.reshape(-1), fired.reshape(-1))
        self.mass.index_add_(0, index.reshape(-1), values.reshape(-1))
        k = index.shape[1]
        rows = max(1, _PAIR_CHUNK // (k * k))
        for idx, val, on in zip(index.split(rows), values.split(rows), fired.split(rows)):
            flat = (idx[:, :, None] * self.width + idx[:, None, :]).reshape(-1)  # (n, k, k) pairs (i, j)
            self.co_mass.view(-1).index_add_(0, flat, (val[:, :, None] * on[:, None, :]).reshape(-1))
            self.co_count.view(-1).index_add_(0, flat, (on[:, :, None] * on[:, None, :]).reshape(-1))

    @property
    def rate(self) -> Tensor:
        """Firing rate of each latent, `(width,)`."""
        return self.count / max(self.n, 1)

    @property
    def W(self) -> Tensor:
        """`(width, width)`: W[i, j] = share of i's activation mass while j fires (0 if i never fires)."""
        return self.co_mass / torch.where(self.mass > 0, self.mass, torch.ones_like(self.mass))[:, None]

    def flush(self) -> None:
        """Nothing is held back."""

    def stats(self) -> CoactivationSummary:
        return CoactivationSummary(self.n, (self.count > 0).double().mean().item())

    def state_dict(self) -> dict[str, Any]:
        return {"config": self.config_dict(), "n": self.n, "count": self.count,
                "mass": self.mass, "co_mass": self.co_mass, "co_count": self.co_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        state = self._placed(state)
        self.n = int(state["n"])
        for key in ("count", "mass", "co_mass", "co_count"):
            setattr(self, key, state[key].clone())

    def _merge(self, other: CoactivationStats) -> None:
        """Add another worker's sums: equals one run over both streams."""
        if (other.width, other.top) != (self.width, self.top):
            raise ValueError(f"cannot merge width={other.width}, top={other.top} into width={self.width}, top={self.top}")
        self.n += other.n
        for key in ("count", "mass", "co_mass", "co_count"):
            getattr(self, key).add_(getattr(other, key).to(self.count.device))


def _candidate_edges(W: Tensor, alive: Tensor, threshold: float) -> list[tuple[int, int]]:
    """(p, c) pairs with W[c, p] > threshold > W[p, c], both alive. W: `(width, width)`."""
    inside = (W.T > threshold) & (W < threshold) & alive[:, None] & alive[None, :]  # [p, c]: W_cp > t, W_pc < t
    inside.fill_diagonal_(False)
    return [tuple(e) for e in inside.nonzero().tolist()]


def build_dag(
    stats: CoactivationStats,
    min_rate: float = 40e-6,
    min_count: int = 20,
    threshold: float = 0.9,
    max_out_frac: float = 0.05,
    min_descendants: int = 5,
) -> nx.DiGraph:
    """The latent hierarchy as a DAG of latent indices, edges parent -> child.

        dag = build_dag(stats)       # nodes carry rate and count; edges W_cp and W_pc

    1. drop latents firing below `min_rate` (40 per million, the released code's filter) or on
    fewer than `min_count` samples (20, the paper's text); 2. edge p -> c iff W[c, p] >
    threshold and W[p, c] < threshold; edges inside a directed cycle (possible, though rare,
    with weighted shares) are dropped; 3. transitive reduction; 4. delete nodes with more than
    `max_out_frac * width` children (hubs that contain everything); 5. keep roots with at least
    `min_descendants` descendants, and their descendants.
    """
    alive = (stats.rate >= min_rate) & (stats.count >= max(min_count, 1))
    graph = nx.DiGraph(width=stats.width, n_alive=int(alive.sum()), threshold=threshold, min_rate=min_rate,
                       min_count=min_count)
    for i in alive.nonzero().flatten().tolist():
        graph.add_node(i, rate=float(stats.rate[i]), count=float(stats.count[i]))
    W = stats.W
    graph.add_edges_from((p, c, {"W_cp": float(W[c, p]), "W_pc": float(W[p, c])})
                         for p, c in _candidate_edges(W, alive, threshold))
    for component in nx.strongly_connected_components(graph):
        if len(component) > 1:
            graph.remove_edges_from([(u, v) for u, v in graph.subgraph(component).edges])
    reduced = nx.transitive_reduction(graph)
    reduced.graph.update(graph.graph)
    reduced.add_nodes_from(graph.nodes(data=True))
    reduced.add_edges_from((u, v, graph.edges[u, v]) for u, v in reduced.edges)
    reduced.remove_nodes_from([n for n, d in reduced.out_degree if d > max_out_frac * stats.width])
    keep = set()
    for root in [n for n, d in reduced.in_degree if d == 0]:
        below = nx.descendants(reduced, root)
        if len(below) >= min_descendants:
            keep |= below | {root}
    dag = reduced.subgraph(keep).copy()
    dag.graph.update(reduced.graph)
    return dag


def dag_depth(dag: nx.DiGraph) -> int:
    """Maximum depth of the DAG: the paper's protocol hangs every root under one virtual root
    and takes shortest-path lengths from it, so roots sit at depth 1 (0 for an empty graph)."""
    if dag.number_of_nodes() == 0:
        return 0
    roots = [n for n, d in dag.in_degree if d == 0]
    return 1 + max(nx.multi_source_dijkstra_path_length(dag, roots, weight=lambda u, v, e: 1).values())


def export_dag(dag: nx.DiGraph, stem: str | os.PathLike, labels: dict[int, str] | None = None) -> dict[str, Path]:
    """Write `<stem>.json` (node-link), `<stem>.graphml` and a layered drawing `<stem>.png`.

        export_dag(dag, "run/hierarchy", labels={12: "sports", 40: "football"})
    """
    import json

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from conceptlens._io import atomic_write

    stem = Path(stem)
    paths = {ext: stem.with_suffix(f".{ext}") for ext in ("json", "graphml", "png")}
    data = nx.node_link_data(dag, edges="edges")

    def write_json(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)

    atomic_write(paths["json"], write_json)
    atomic_write(paths["graphml"], lambda tmp: nx.write_graphml(dag, tmp))
    drawn = dag.copy()  # the layout needs a depth attribute the caller's graph should not get
    for depth, layer in enumerate(nx.topological_generations(drawn)):
        for n in layer:
            drawn.nodes[n]["depth"] = depth
    fig = Figure(figsize=(max(6.0, drawn.number_of_nodes() ** 0.5 * 2), 6.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_axis_off()
    if drawn.number_of_nodes():
        pos = nx.multipartite_layout(drawn, subset_key="depth", align="horizontal")
        pos = {n: (x, -y) for n, (x, y) in pos.items()}  # roots on top
        names = {n: (labels or {}).get(n, str(n)) for n in drawn}
        nx.draw_networkx(drawn, pos, ax=ax, labels=names, node_size=300, font_size=7)
    atomic_write(paths["png"], lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    return paths
