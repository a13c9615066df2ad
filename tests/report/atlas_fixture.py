"""Write a run folder in the atlas layout (concepts/, describe/, hierarchy/) from random data.

    write_fake_run(tmp_path / "run", [("topk", "topk-sae", 24), ("kmeans", "kmeans", 16)])

Used by the report tests and benchmarks/report.py; the layout is the one `conceptlens fit`
and `describe` write (DESIGN.md, "Atlas run folder").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from safetensors.numpy import save_file

from conceptlens.concepts.conceptset import ConceptSet

WORDS = [" the", " match", " goal", " market", " shares", " film", " band", " election", " minister", " phone",
         " software", " cup", " league", " bank", " profit", " actor", " album", " vote", " labour", " internet",
         ",", ".", "\n", " of", " and", " a", " to", " in", " said", " year"]
LABELS = ["business", "entertainment", "politics", "sport", "tech"]


def _stats(rng: np.random.Generator, n: int, d: int, top_n: int, bins: int, labels: bool, decoder: bool,
           directions: np.ndarray) -> dict[str, np.ndarray]:
    top = -np.sort(-rng.gamma(2.0, 3.0, size=(n, top_n)), axis=1).astype(np.float32)
    m = min(8, n - 1)
    cos = directions @ directions.T
    np.fill_diagonal(cos, -np.inf)
    near = np.argsort(-cos, axis=1)[:, :m]
    lo = np.zeros((n, 1), np.float32)
    edges = (lo + np.linspace(0, 1, bins + 1, dtype=np.float32)[None] * top[:, :1]).astype(np.float32)
    stats = {
        "frequency": rng.uniform(0.001, 0.2, n).astype(np.float32),
        "mean_activation": rng.uniform(0.5, 3, n).astype(np.float32),
        "max_activation": top[:, 0].copy(),
        "hist_edges": edges, "hist_counts": rng.integers(0, 500, size=(n, bins)).astype(np.int64),
        "top_values": top, "top_doc": rng.integers(0, 100, (n, top_n)).astype(np.int64),
        "top_pos": rng.integers(1, 120, (n, top_n)).astype(np.int64),
        "nearest_direction": near.astype(np.int64),
        "nearest_direction_cos": np.take_along_axis(cos, near, 1).astype(np.float32),
        "nearest_coact": rng.integers(0, n, (n, m)).astype(np.int64),
        "nearest_coact_score": rng.uniform(0, 1, (n, m)).astype(np.float32),
        "map_xy": rng.normal(size=(n, 2)).astype(np.float32),
    }
    if decoder:
        stats |= {"promoted_ids": rng.integers(0, 49152, (n, 10)).astype(np.int64),
                  "suppressed_ids": rng.integers(0, 49152, (n, 10)).astype(np.int64),
                  "promoted_logit": -np.sort(-rng.normal(3, 1, (n, 10)), 1).astype(np.float32),
                  "suppressed_logit": np.sort(rng.normal(-3, 1, (n, 10)), 1).astype(np.float32)}
    if labels:
        stats["probe_loss"] = rng.uniform(0.2, 0.6, (n, len(LABELS))).astype(np.float32)
    return stats


def _contexts(rng: np.random.Generator, top: np.ndarray, window: tuple[int, int]) -> list[str]:
    lines = []
    for i, values in enumerate(top):
        words = rng.integers(0, len(WORDS), size=(len(values), sum(window) + 1))
        acts = np.round(rng.uniform(0, 1, size=words.shape) * values[:, None] * 0.5, 3)
        acts[:, window[0]] = values
        ctx = [{"value": float(v), "doc": int(rng.integers(100)), "pos": int(rng.integers(1, 120)),
                "center": window[0], "tokens": [WORDS[w] for w in row], "acts": a.tolist()}
               for v, row, a in zip(values.tolist(), words, acts)]
        lines.append(json.dumps({"concept": i, "contexts": ctx}))
    return lines


def write_fake_run(run: Path, extractors: Sequence[tuple[str, str, int]], *, d: int = 32,
                   site: str = "blocks.1.resid_out", top_n: int = 6, window: tuple[int, int] = (8, 4),
                   bins: int = 20, labels: bool = True, steering: bool = True, hierarchy: str | None = None,
                   seed: int = 0) -> Path:
    """A run folder with one ConceptSet and one description per `(name, method, n)`."""
    rng = np.random.default_rng(seed)
    run.mkdir(parents=True, exist_ok=True)
    (run / "run.toml").write_text(f'model = "tiny"\ndata = "bbc-news"\nsites = ["{site}"]\n')
    (run / "fit_report.json").write_text(json.dumps({"tokens": 5000, "documents": 40, "batches": 5, "seconds": 1.5,
                                                      "resumed_from": 0, "rows": {}, "extractors": {}}))
    for name, method, n in extractors:
        decoder = method != "kmeans"
        directions = rng.normal(size=(n, d)).astype(np.float32)
        ConceptSet(torch.from_numpy(directions), site, method=method, model="tiny").save(run / "concepts" / name)
        unit = directions / np.linalg.norm(directions, axis=1, keepdims=True)
        folder = run / "describe" / name
        folder.mkdir(parents=True, exist_ok=True)
        stats = _stats(rng, n, d, top_n, bins, labels, decoder, unit)
        save_file(stats, folder / "stats.safetensors")
        (folder / "contexts.jsonl").write_text("\n".join(_contexts(rng, stats["top_values"], window)) + "\n")
        if decoder:
            pick = lambda key: [[WORDS[j % len(WORDS)] for j in row] for row in stats[key].tolist()]  # noqa: E731
            (folder / "tokens.json").write_text(json.dumps({"promoted": pick("promoted_ids"),
                                                            "suppressed": pick("suppressed_ids")}))
        samples = [{"concept": 1, "prompt": "I went to the shop and", "site_norm": 17.0,
                    "samples": [{"alpha": a, "scale": "site_norm", "text": f" text at alpha {a} <b>"}
                                for a in (0.0, 0.5, 1.0)]}] if steering else []
        meta = {"format": "conceptlens.Description", "version": 1, "name": name, "site": site, "method": method,
                "model": "tiny", "n_concepts": n, "tokens": 4000, "documents": 30, "top_n": top_n,
                "window": list(window), "hist_edges_kind": "per-concept", "labels": LABELS if labels else None,
                "base_rate_entropy": {c: 0.5 for c in LABELS} if labels else None,
                "has_unembedding": decoder, "steering": samples}
        (folder / "description.json").write_text(json.dumps(meta))
    if hierarchy:
        _hierarchy(run, hierarchy, next(n for name, _, n in extractors if name == hierarchy))
    return run


def _hierarchy(run: Path, name: str, n: int) -> None:
    """A small DAG (0 -> 1, 2; 1 -> 3, 4) as node-link JSON, as `export_dag` writes it."""
    import networkx as nx

    dag = nx.DiGraph(width=n, n_alive=n)
    dag.add_edges_from([(0, 1), (0, 2), (1, 3), (1, 4)], W_cp=0.95, W_pc=0.3)
    (run / "hierarchy").mkdir(exist_ok=True)
    (run / "hierarchy" / f"{name}.json").write_text(json.dumps(nx.node_link_data(dag, edges="edges")))
