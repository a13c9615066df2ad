"""benchmarks/demo_defaults.py's folds, variants and table, so the script behind the demo's defaults cannot rot."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import demo_defaults  # noqa: E402

from conceptlens.evaluate.activations import Probed  # noqa: E402


def pool(docs: int, rows_per_doc: int = 2) -> Probed:
    doc = torch.arange(docs).repeat_interleave(rows_per_doc)
    return Probed(doc[:, None].float(), {"set": doc[:, None].float()}, doc % 5, doc)


@pytest.mark.parametrize("n_train", [0, 15])
def test_validate_trains_on_one_fold_or_on_the_first_articles_of_the_others(monkeypatch, n_train):
    import conceptlens.evaluate.probing as probing

    seen = []
    monkeypatch.setattr(probing, "probing_lines", lambda task, train, test, *a, **kw: seen.append(
        (train.x[:, 0].unique().tolist(), test.x[:, 0].unique().tolist())) or [])
    demo_defaults.validate(pool(30), ["a", "b", "c", "d", "e"], folds=3, seed=0, n_train=n_train)
    folds = [list(range(0, 10)), list(range(10, 20)), list(range(20, 30))]
    for f, (train, test) in enumerate(seen):
        others = [d for j, fold in enumerate(folds) if j != f for d in fold]
        assert (train, test) == ((others[:n_train], folds[f]) if n_train else (folds[f], others))
    assert len(seen) == 3


def test_validate_refuses_more_train_articles_than_the_other_folds_hold():
    with pytest.raises(ValueError, match="cannot train on 21 articles: the other folds hold 20"):
        demo_defaults.validate(pool(30), ["a", "b", "c", "d", "e"], folds=3, seed=0, n_train=21)


@pytest.mark.parametrize("variant", ["kmeans", "kmeans:spherical", "sae:k=4", "kmeans:=1"])
def test_a_malformed_variant_names_the_form_and_the_methods(variant):
    with pytest.raises(ValueError, match="METHOD:KEY=VALUE with METHOD one of topk, deleuzian, kmeans"):
        demo_defaults.candidates([8], [2048], [2.0], [32], [], [variant])


def test_a_variant_copies_its_method_candidates_with_the_option():
    base = demo_defaults.candidates([8], [2048], [2.0], [32, 64], [])
    got = demo_defaults.candidates([8], [2048], [2.0], [32, 64], [], ["kmeans:spherical=true", "deleuzian:mode=x"])
    extra = got[len(base):]
    assert [c.name for c in extra] == ["b15_kmeans_32_spherical-true", "b15_kmeans_64_spherical-true",
                                       "b15_deleuzian_32_mode-x", "b15_deleuzian_64_mode-x"]
    assert extra[0].options["spec"] == {"spherical": True} and extra[2].options["spec"] == {"mode": "x"}


def test_the_table_keeps_train_test_splits_apart_and_marks_old_records():
    rec = lambda split, win: {"set": "s", "length": 64, "topic": "sport", "seed": 0, "value": 0.9, "control": 0.7,
                              "win": win} | ({"split": split} if split else {})
    lines = demo_defaults.table([rec("240/480", True), rec("240/240", False), rec(None, True)]).splitlines()
    assert [ln.split()[2] for ln in lines[1:]] == ["240/480", "240/240", "-"]
    assert [ln.split()[-1] for ln in lines[1:]] == ["1/1", "0/1", "1/1"]


def test_the_table_keeps_models_apart():
    rec = lambda model, win: {"set": "b9_kmeans_32", "length": 64, "topic": "sport", "seed": 0, "value": 0.9,
                              "control": 0.7, "win": win, "split": "240/480"} | ({"model": model} if model else {})
    lines = demo_defaults.table([rec(None, True), rec("/m/gemma.gguf", False), rec("smollm2-135m", True)]).splitlines()
    assert [(ln.split()[0], ln.split()[-1]) for ln in lines[1:]] == [("b9_kmeans_32", "2/2"),
                                                                     ("gemma.gguf:b9_kmeans_32", "0/1")]


def test_the_grid_sits_at_the_given_demo_site():
    got = demo_defaults.candidates([8], [2048], [2.0], [32], ["blocks.6.resid_out"], demo_site="blocks.9.resid_out")
    assert [(c.name, c.site) for c in got] == [
        ("b9_topk_w2048_k8_lr2x", "blocks.9.resid_out"), ("b9_deleuzian_32", "blocks.9.resid_out"),
        ("b9_kmeans_32", "blocks.9.resid_out"), ("b6_topk_w2048_k8_lr2x", "blocks.6.resid_out"),
        ("b6_deleuzian_32", "blocks.6.resid_out"), ("b6_kmeans_32", "blocks.6.resid_out")]


def test_the_pool_holds_no_article_a_fit_read_nor_any_twice():
    texts = [f"article {i % 40}" for i in range(60)]  # 20 articles repeated
    orders = [torch.randperm(60, generator=torch.Generator().manual_seed(s)).tolist() for s in (0, 1)]
    pool = demo_defaults.pool_documents(texts, [0, 1], 5, 20)
    read = {texts[i] for order in orders for i in order[:5]}
    assert len(pool) == 20 and len({texts[i] for i in pool}) == 20 and not read & {texts[i] for i in pool}
    assert pool == [i for i in orders[0] if texts[i] not in read and texts[i] not in
                    {texts[j] for j in orders[0][:orders[0].index(i)]}][:20]  # first sightings, seed 0's order
    with pytest.raises(ValueError, match="only 3. train articles lie outside the fits"):
        demo_defaults.pool_documents(texts, [0, 1], 5, 39)
