"""The paper's hierarchy scores (002) against hand-computed values and a brute-force pair sum."""

import math

import pytest
import torch

from conceptlens.metrics.hierarchy import CoactivationStats, build_dag
from conceptlens.metrics.hierarchy_eval import graph_activations, hierarchy_scores, monosemanticity
from tests.metrics.test_hierarchy import TOY

# one 2-D embedding per TOY row: "dog" rows point along x, "cat" rows along y, "animal alone" in between
EMB = torch.tensor([[1.0, 0], [1, 0], [0, 1], [0, 1], [1, 1], [1, 0], [0, 1], [1, 0]])


def _brute_s_m(z, e):
    a = z.double().clamp_min(0)
    a = (a - a.min(0).values) / (a.max(0).values - a.min(0).values)
    e = torch.nn.functional.normalize(e.double(), dim=1)
    out = []
    for f in range(a.shape[1]):
        num = den = 0.0
        for i in range(a.shape[0]):
            for j in range(i + 1, a.shape[0]):  # the released code's i < j
                w = float(a[i, f] * a[j, f])
                num += w * float(e[i] @ e[j])
                den += w
        out.append(num / den)
    return torch.tensor(out, dtype=torch.float64)


def test_monosemanticity_by_hand_and_against_the_pair_sum():
    z = torch.tensor([[1.0, 2.0], [0.5, 0.0], [0.0, 2.0]])
    e = torch.tensor([[1.0, 0.0], [0.0, 3.0], [2.0, 0.0]])
    # feature 0: a~ = (1, .5, 0): the only weighted pair (1, 2) has cosine 0; feature 1: a~ = (1, 0, 1), cosine 1
    torch.testing.assert_close(monosemanticity(z, e), torch.tensor([0.0, 1.0], dtype=torch.float64))
    g = torch.Generator().manual_seed(0)
    z, e = torch.rand(30, 6, generator=g), torch.randn(30, 4, generator=g)
    torch.testing.assert_close(monosemanticity(z, e), _brute_s_m(z, e))
    assert math.isnan(monosemanticity(torch.ones(4, 1), e[:4])[0])  # constant: no weights
    # dog (latent 1): a~ = a/2, S = (2.5, .25): (6.3125 - 1.8125) / (2.75^2 - 1.8125) = 18/23
    assert monosemanticity(TOY, EMB)[1].item() == pytest.approx(18 / 23)
    with pytest.raises(ValueError, match="same N"):
        monosemanticity(z, e[:3])


def test_graph_activations_keep_each_samples_top_latents():
    a, A = graph_activations(torch.tensor([[3.0, -1.0, 2.0, 1.0]]), top=2)
    assert a.tolist() == [[3.0, 0.0, 2.0, 0.0]] and A.tolist() == [[True, False, True, False]]


def test_toy_scores_by_hand():
    stats = CoactivationStats(width=5)
    stats.update(TOY)
    dag = build_dag(stats, min_rate=0.0, min_count=0, threshold=0.75, max_out_frac=1.0, min_descendants=3)
    assert sorted(dag.edges) == [(0, 1), (0, 2), (1, 3)]
    s = hierarchy_scores(dag, TOY, EMB)
    assert (s.nodes, s.edges, s.depth) == (4, 3, 3)
    # s_ai = P[A_p | A_c]: dog fires 5 times, 4 with animal; cat and puppy always with their parent
    assert s.per_edge["s_ai"] == pytest.approx({(0, 1): 4 / 5, (0, 2): 1.0, (1, 3): 1.0})
    # s_ad = P[a_p >= a_c | both]: animal vs cat at rows 2 (1 < 2) and 3 (2 >= 1); the rest always
    assert s.per_edge["s_ad"] == pytest.approx({(0, 1): 1.0, (0, 2): 0.5, (1, 3): 1.0})
    # s_rf: animal fires on 6 rows, a child on 5 of them (not row 4); dog on 5, puppy on 2
    assert s.per_parent["s_rf"] == pytest.approx({0: 5 / 6, 1: 2 / 5})
    # s_cc(animal): rows with a child 0,1,2,3,5,7: a_p (2,2,1,2,0,3) vs max child (1,1,2,1,1,2):
    # ranks (4,4,2,4,1,6) and (2.5,2.5,5.5,2.5,2.5,5.5): 3 / sqrt(15.5 * 12); dog: puppy constant -> nan
    assert s.per_parent["s_cc"][0] == pytest.approx(3 / math.sqrt(186))
    assert math.isnan(s.per_parent["s_cc"][1])
    # s_ss(animal): dog's weighted mean embedding (5, .5) / 5.5, cat's (0, 1): cosine 1/sqrt(101)
    assert s.per_parent["s_ss"][0] == pytest.approx(1 / math.sqrt(101))
    assert math.isnan(s.per_parent["s_ss"][1])  # one child
    # s_m: animal 0.586 < dog 18/23 < puppy 1, and cat 1: every parent more general
    assert s.per_edge["s_ha"] == {(0, 1): 1.0, (0, 2): 1.0, (1, 3): 1.0}
    assert s.s_ai == pytest.approx((4 / 5 + 2) / 3) and s.s_ad == pytest.approx(2.5 / 3)
    assert s.s_rf == pytest.approx((5 / 6 + 2 / 5) / 2) and s.s_cc == pytest.approx(3 / math.sqrt(186))
    assert s.s_m == pytest.approx(float(monosemanticity(TOY, EMB)[[0, 1, 2, 3]].mean()))
    assert set(s.row()) == {"nodes", "edges", "depth", "s_m", "s_ha", "s_ss", "s_ai", "s_ad", "s_rf", "s_cc"}


def test_min_samples_turns_thin_conditionals_into_nan():
    stats = CoactivationStats(width=5)
    stats.update(TOY)
    dag = build_dag(stats, min_rate=0.0, min_count=0, threshold=0.75, max_out_frac=1.0, min_descendants=3)
    s = hierarchy_scores(dag, TOY, EMB, min_samples=3)
    assert math.isnan(s.per_edge["s_ai"][0, 2]) and s.per_edge["s_ai"][0, 1] == pytest.approx(0.8)
