"""The hierarchy page: the latent DAG of `metrics.hierarchy` drawn as layered inline SVG."""

from __future__ import annotations

from typing import Any

import networkx as nx

from conceptlens.report.html import esc, num, page, table

MAX_DRAWN = 600  # nodes drawn; a larger DAG is listed (edges table) but only its top layers drawn


def dag_from_json(data: dict[str, Any]) -> nx.DiGraph:
    """The DiGraph of a node-link JSON written by `metrics.hierarchy.export_dag`."""
    return nx.node_link_graph(data, directed=True, edges="edges" if "edges" in data else "links")


def family(dag: nx.DiGraph) -> dict[str, list[int]]:
    """{'p12': parents of 12, 'c12': children of 12} for the concept pages."""
    out: dict[str, list[int]] = {}
    for u, v in dag.edges:
        out.setdefault(f"c{u}", []).append(int(v))
        out.setdefault(f"p{v}", []).append(int(u))
    return out


def _href(name: str, node: object) -> str:
    return esc(f"../concepts/{name}/{node}.html", "url")


def _svg(dag: nx.DiGraph, name: str, labels: list[str]) -> str:
    layers = [sorted(layer) for layer in nx.topological_generations(dag)]
    drawn: set[int] = set()  # latent indices
    kept = []
    for layer in layers:
        if len(drawn) + len(layer) > MAX_DRAWN:
            break
        drawn |= set(layer)
        kept.append(layer)
    if not kept:
        return ""
    width, row_h = max(720, 26 * max(len(layer) for layer in kept)), 90
    pos = {n: (width * (k + 0.5) / len(layer), 30 + row_h * depth) for depth, layer in enumerate(kept)
           for k, n in enumerate(layer)}
    edges = "".join(f'<line x1="{pos[u][0]:.0f}" y1="{pos[u][1]:.0f}" x2="{pos[v][0]:.0f}" y2="{pos[v][1]:.0f}" '
                    f'stroke="#9aa5b8"/>' for u, v in dag.edges if u in pos and v in pos)
    nodes = "".join(f'<a href="{_href(name, n)}"><circle cx="{x:.0f}" cy="{y:.0f}" r="9" fill="#4a6fa5">'
                    f'<title>#{esc(n)} {esc(labels[n] if n < len(labels) else "")}</title></circle>'
                    f'<text x="{x:.0f}" y="{y + 21:.0f}" text-anchor="middle">{esc(n)}</text></a>' for n, (x, y) in pos.items())
    return f'<svg width="{width}" height="{30 + row_h * len(kept)}" id="dag">{edges}{nodes}</svg>'


def hierarchy_page(name: str, data: dict[str, Any], labels: list[str]) -> str:
    dag = dag_from_json(data)
    graph = data.get("graph", {})
    scores = data.get("scores") or graph.get("scores")
    info = (f'<p class="meta">{dag.number_of_nodes()} latents and {dag.number_of_edges()} edges (parent &rarr; child: '
            f'the child fires almost only while the parent fires)'
            + (f"; {esc(graph['n_alive'])} latents alive" if "n_alive" in graph else "") + "</p>")
    if isinstance(scores, dict):
        info += table(["score", "value"], [(esc(k), num(v)) for k, v in scores.items()], [False, True])
    rows = [(f'<a href="{_href(name, u)}">#{esc(u)}</a> <span class="muted">{esc(labels[u])}</span>',
             f'<a href="{_href(name, v)}">#{esc(v)}</a> <span class="muted">{esc(labels[v])}</span>',
             num(d.get("W_cp"), 3), num(d.get("W_pc"), 3)) for u, v, d in sorted(dag.edges(data=True))]
    body = info + _svg(dag, name, labels) + "<h2>Edges</h2>" + table(
        ["parent", "child", "W child-in-parent", "W parent-in-child"], rows, [False, False, True, True])
    return page(f"Hierarchy of {name}", body, "../", [("index.html", "index"), ("matches.html", "matches")])
