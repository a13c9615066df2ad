import io
import json

import networkx as nx
import pytest
import torch

import conceptlens.metrics.hierarchy as hierarchy
from conceptlens.metrics.hierarchy import CoactivationStats, build_dag, dag_depth, export_dag

# Toy SAE with 5 latents: 0 "animal", 1 "dog", 2 "cat", 3 "puppy" (inside dog), 4 unrelated.
TOY = torch.tensor([
    [2.0, 1.0, 0.0, 0.0, 0.0],  # dog
    [2.0, 1.0, 0.0, 1.0, 0.0],  # puppy
    [1.0, 0.0, 2.0, 0.0, 0.0],  # cat
    [2.0, 0.5, 1.0, 0.0, 0.0],  # cat, with a little dog
    [4.0, 0.0, 0.0, 0.0, 0.0],  # animal alone
    [0.0, 1.0, 0.0, 0.0, 2.0],  # dog without animal: hard absorption
    [0.0, 0.0, 0.0, 0.0, 1.0],
    [3.0, 2.0, 0.0, 1.0, -1.0],  # puppy (negative = silent)
])


def _toy_dag():
    stats = CoactivationStats(width=5)
    stats.update(TOY)
    return build_dag(stats, min_rate=0.0, min_count=0, threshold=0.75, max_out_frac=1.0, min_descendants=3), stats


def _dense_reference(z, top):
    """Whole-matrix statistics: binarise, then plain matrix products."""
    a = z.double().clamp_min(0)
    keep = torch.zeros_like(a).scatter(1, a.topk(top, dim=1).indices, 1.0)
    B = keep * (a > 0)
    return B.sum(0), (a * B).sum(0), (a * B).T @ B, B.T @ B


def test_streamed_statistics_equal_whole_matrix(monkeypatch):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(500, 40, generator=g) * (torch.rand(500, 40, generator=g) < 0.3)
    monkeypatch.setattr(hierarchy, "_PAIR_CHUNK", 8 * 8 * 7)  # several scatter chunks per batch
    streamed, a, b = CoactivationStats(40, top=8), CoactivationStats(40, top=8), CoactivationStats(40, top=8)
    for chunk in z.split(120):
        streamed.update(chunk)
    count, mass, co_mass, co_count = _dense_reference(z, top=8)
    for got, want in zip((streamed.count, streamed.mass, streamed.co_mass, streamed.co_count),
                         (count, mass, co_mass, co_count)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert (co_count.diagonal() == count).all() and streamed.n == 500
    a.update(z[:200])
    b.update(z[200:])
    a.merge(b)
    torch.testing.assert_close(a.co_mass, streamed.co_mass, rtol=1e-12, atol=1e-12)
    assert a.n == 500


def test_state_dict_round_trip_and_errors():
    stats = CoactivationStats(width=5, top=3)
    stats.update(TOY[:4])
    buf = io.BytesIO()
    torch.save(stats.state_dict(), buf)
    buf.seek(0)
    resumed = CoactivationStats(width=5, top=3)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    resumed.update(TOY[4:])
    stats.update(TOY[4:])
    assert torch.equal(resumed.co_mass, stats.co_mass) and torch.equal(resumed.count, stats.count)
    with pytest.raises(ValueError, match=r"\('top', 3, 64\)"):
        CoactivationStats(width=5).load_state_dict(stats.state_dict())
    with pytest.raises(ValueError, match=r"shape \(N, 5\)"):
        stats.update(torch.zeros(3, 4))


def test_toy_dag_structure():
    dag, stats = _toy_dag()
    # W[1, 0] = (1 + 1 + 0.5 + 2) / 5.5 = 9/11 > 0.75 and W[0, 1] = 9/14 < 0.75: animal -> dog
    assert stats.W[1, 0].item() == pytest.approx(9 / 11) and stats.W[0, 1].item() == pytest.approx(9 / 14)
    # animal -> puppy is implied by animal -> dog -> puppy; latent 4 has no parent or children
    assert sorted(dag.edges) == [(0, 1), (0, 2), (1, 3)]
    assert dag.graph["n_alive"] == 5
    assert dag.nodes[0]["rate"] == pytest.approx(6 / 8)
    assert dag.edges[0, 2]["W_cp"] == pytest.approx(1.0) and dag.edges[0, 2]["W_pc"] == pytest.approx(3 / 14)


def test_depth_counts_roots_as_one():
    dag, _ = _toy_dag()
    assert dag_depth(dag) == 3  # animal (1) -> dog (2) -> puppy (3)
    assert dag_depth(nx.DiGraph()) == 0


def test_min_count_is_the_papers_twenty_samples():
    stats = CoactivationStats(width=5)
    stats.update(TOY)
    assert build_dag(stats, min_rate=0.0).number_of_nodes() == 0  # 8 samples: nobody fires 20 times
    # a count floor of 3 removes cat and puppy (2 firings each) and with them every child but dog
    dag = build_dag(stats, min_rate=0.0, min_count=3, threshold=0.75, max_out_frac=1.0, min_descendants=1)
    assert sorted(dag.edges) == [(0, 1)]


def test_dag_filters():
    stats = CoactivationStats(width=5)
    stats.update(TOY)
    assert build_dag(stats, min_rate=0.0, min_count=0, threshold=0.75, max_out_frac=1.0, min_descendants=4).number_of_nodes() == 0
    # animal has 2 children: above 0.2 * 5 = 1 child it is deleted; dog -> puppy is then too small a tree
    hubless = build_dag(stats, min_rate=0.0, min_count=0, threshold=0.75, max_out_frac=0.2, min_descendants=1)
    assert sorted(hubless.edges) == [(1, 3)]
    # a rate floor above puppy's 2/8 removes it, and with it dog's only child
    assert sorted(build_dag(stats, min_rate=0.3, min_count=0, threshold=0.75, max_out_frac=1.0, min_descendants=1).edges) == [(0, 1)]
    assert build_dag(stats, min_rate=0.0, min_count=0, threshold=0.75, min_descendants=9).number_of_nodes() == 0


def test_export_writes_json_graphml_and_png(tmp_path):
    dag, _ = _toy_dag()
    paths = export_dag(dag, tmp_path / "hierarchy", labels={0: "animal"})
    data = json.loads(paths["json"].read_text())
    assert sorted((e["source"], e["target"]) for e in data["edges"]) == sorted(dag.edges)
    assert sorted(nx.read_graphml(paths["graphml"], node_type=int).edges) == sorted(dag.edges)
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "depth" not in dag.nodes[0]  # the caller's graph is untouched
