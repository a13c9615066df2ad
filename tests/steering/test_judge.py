"""The topic judge against scikit-learn on hand-pooled embeddings, as a sweep judge, and the
best-within-budget choice against a hand computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression

from conceptlens.commands import demo_steer
from conceptlens.steering import Add, sweep, token_logprob
from conceptlens.steering.judge import TopicJudge, best_within_budget
from conceptlens.steering.sweep import SweepResult
from tests.steering.test_sweep import PROMPTS, setup  # noqa: F401  (fixture)


def _texts():
    g = torch.Generator().manual_seed(0)
    low = [" ".join(f"w{int(i)}" for i in torch.randint(3, 30, (int(n),), generator=g))
           for n in torch.randint(3, 9, (12,), generator=g)]
    high = [" ".join(f"w{int(i)}" for i in torch.randint(60, 99, (int(n),), generator=g))
            for n in torch.randint(3, 9, (12,), generator=g)]
    return low + high, ["low"] * 12 + ["high"] * 12


def test_judge_is_logistic_regression_on_mean_pooled_states(setup):
    model, tok, _ = setup
    texts, labels = _texts()
    judge = TopicJudge(model, tok, texts, labels, batch_size=5)
    with torch.no_grad():  # one text at a time, no padding: the plain mean of the last hidden states
        pooled = np.stack([model(**tok(t, return_tensors="pt"), output_hidden_states=True).hidden_states[-1][0]
                           .double().mean(0).numpy() for t in texts])
    reference = LogisticRegression(max_iter=2000, random_state=0).fit(pooled, labels)
    assert judge.classes == list(reference.classes_)
    np.testing.assert_allclose(judge.probabilities(texts), reference.predict_proba(pooled), atol=1e-5)
    assert judge.accuracy(texts, labels) == pytest.approx(float(np.mean(reference.predict(pooled) == labels)))
    with pytest.raises(ValueError, match="'sport'.*high, low"):
        judge.topic("sport")


def test_sweep_records_the_judge_per_alpha(setup):
    model, tok, lens = setup
    texts, labels = _texts()
    judge = TopicJudge(model, tok, texts, labels)
    direction = model.get_output_embeddings().weight[80].detach()
    result = sweep(lens, Add(direction, 0.0, site="final"), [0, 3, 30], PROMPTS, token_logprob(tok, "w80"),
                   max_new_tokens=4, judge=judge.topic("high"))
    assert result.judged["P(high)"].shape == (3, len(PROMPTS))
    column = judge.classes.index("high")
    for a, continuations in enumerate(result.texts):
        expected = judge.probabilities(continuations)[:, column]
        np.testing.assert_allclose(result.judged["P(high)"][a].numpy(), expected, atol=1e-12)
    assert "P(high)" in result.table()


def _result(alphas, medians, judged):
    """A SweepResult whose per-prompt perplexity is each alpha's median (reference median 2)."""
    ppl = torch.tensor(medians, dtype=torch.float64)[:, None].repeat(1, 2)
    scores = torch.zeros(len(alphas), 2, dtype=torch.float64)
    judged = torch.tensor(judged, dtype=torch.float64)[:, None].repeat(1, 2)
    return SweepResult(list(alphas), scores, [["", ""]] * len(alphas), "s", ppl, torch.full((2,), 2.0,
                       dtype=torch.float64), 2.0, {"P(x)": judged})


def test_best_within_budget_by_hand():
    # budget 2 x 2 = 4: alphas 0, 0.5 and 2 read fluently, 1 does not; the walk stops at 1, so the
    # higher P at 2 (salad that reads fluently again) is out, and the best in budget is 0.5
    result = _result([0, 0.5, 1, 2, -1], [2, 3, 5, 3, 3.5], [0.1, 0.3, 0.8, 0.9, 0.2])
    assert best_within_budget(result, "P(x)") == (0.5, pytest.approx(0.3))
    # the negative side is walked too: -1 is fluent and higher than the positive side's best
    result = _result([0, 0.5, -1], [2, 3, 3.5], [0.1, 0.3, 0.6])
    assert best_within_budget(result, "P(x)") == (-1.0, pytest.approx(0.6))
    # an alpha whose continuations are all empty (nan) never wins
    result = _result([0, 1], [2, 3], [0.1, math.nan])
    assert best_within_budget(result, "P(x)") == (0.0, pytest.approx(0.1))
    with pytest.raises(ValueError, match="'P\\(y\\)'"):
        best_within_budget(result, "P(y)")


def test_demo_comparison_has_four_rows_and_names_the_loser(setup):
    model, tok, lens = setup
    texts, labels = _texts()
    judge = TopicJudge(model, tok, texts, labels)
    g = torch.Generator().manual_seed(0)
    directions = {"set:3": torch.randn(model.config.hidden_size, generator=g),
                  "diff-of-means": demo_steer.diff_of_means(lens, tok, "blocks.1.resid_out", texts, labels, "high",
                                                            n=6),
                  "random": torch.randn(model.config.hidden_size, generator=g)}
    rows = demo_steer.compare(lens, tok, "blocks.1.resid_out", 1.0, directions, judge.topic("high"), "high",
                              PROMPTS, alphas=(0.0, 1.0, 4.0), max_new_tokens=4)
    assert [r["row"] for r in rows] == ["set:3", "diff-of-means", "random", "prefix 'Write about high.'"]
    for r in rows[:3]:  # each steered row's best is the hand-computed best among its walk-fluent alphas
        limit = 2 * r["perplexity"][0]
        walk = []
        for a, p, q in zip(r["alphas"], r["p"], r["perplexity"]):
            if not q <= limit:
                break
            walk.append((p, a))
        assert r["best"] == (max(walk)[1], pytest.approx(max(walk)[0]))
    table = demo_steer.format_rows(rows, "high")
    assert all(r["row"] in table for r in rows) and len(table.splitlines()) == 1 + 2 * 4


def test_demo_table_and_verdict_read_the_saved_lines_intervals_and_paired_differences():
    """The printed best cells carry the bootstrap intervals over prompts that `label_lines` saves for
    the atlas, and the verdict sets the concept against diff-of-means and the random direction by
    the paired differences: worse than diff-of-means on every prompt, better than random on every one."""
    from conceptlens.evaluate.lines import verdict
    from conceptlens.evaluate.steering import label_lines

    def row(name, scores, best):
        alphas = [0.0, 0.5][:len(scores)]
        return {"row": name, "alphas": alphas, "scores": scores, "p": [sum(s) / len(s) for s in scores],
                "perplexity": [3.0] * len(scores), "fluent": [True] * len(scores), "best": best}

    unsteered = [0.1] * 4
    rows = [row("kmeans:6", [unsteered, [0.2, 0.25, 0.15, 0.2]], (0.5, 0.2)),
            row("diff-of-means", [unsteered, [0.7, 0.8, 0.6, 0.7]], (0.5, 0.7)),
            row("random", [unsteered, [0.1, 0.12, 0.08, 0.1]], (0.5, 0.1)),
            row("prefix 'Write about sports.'", [[0.4, 0.5, 0.3, 0.4]], (0.0, 0.4))]
    lines = label_lines("bbc-news", "sports", {"kmeans": (6, "kmeans:6")}, rows, seed=0)
    table = demo_steer.format_rows(rows, "sports", demo_steer.intervals(rows, lines)).splitlines()
    shown = dict(zip(("random direction", "diff-of-means", "prompt prefix"), (table[5], table[3], table[7])))
    for (name, est), cell in [(("kmeans", lines[0].value), table[1]), *((b, shown[b[0]]) for b in lines[0].baselines)]:
        assert 0 < est.low < est.high and cell.endswith(f"[{est.low:.3f}, {est.high:.3f}]"
                                                        + ("" if "prefix" in cell else " at alpha 0.5")), (name, cell)
    said = demo_steer.verdict(rows, "sports", lines).splitlines()
    worse, better = (next(ln for ln in lines if ln.metric.endswith(f" minus {b}")) for b in ("diff-of-means", "random"))
    assert (verdict(worse), verdict(better)) == ("loses", "wins")
    assert said[0].startswith("Highest point value within the fluency budget: diff-of-means")
    assert said[1] == (f"The fitted concept steers worse than the diff-of-means vector: paired difference -0.500 "
                       f"[{worse.value.low:+.3f}, {worse.value.high:+.3f}] over the 4 prompts, as AxBench found for "
                       "SAE latents.")
    assert said[2] == (f"The fitted concept steers better than a random direction: paired difference +0.100 "
                       f"[{better.value.low:+.3f}, {better.value.high:+.3f}] over the 4 prompts.")
    rows[2]["best"] = (0.0, 0.1)  # a random direction no alpha of which did better than its unsteered text
    lines = label_lines("bbc-news", "sports", {"kmeans": (6, "kmeans:6")}, rows, seed=0)
    said = demo_steer.verdict(rows, "sports", lines).splitlines()
    assert said[-1].startswith("The fitted concept steers better than a random direction: paired difference +0.100")
    assert said[-1].endswith("(the random direction's best within the budget is alpha 0, so this sets the concept "
                             "against no steering).")


def test_a_direction_whose_best_within_budget_is_alpha_0_is_said_to_be_unsteered():
    """The demo's diff-of-means row of 2026-12-05: P 0.063 unsteered, lower at 0.25, 0.508 at 0.5 but
    over the budget; its best within the budget is the unsteered continuations, which the table and the
    verdict say instead of showing 0.063 as the vector's score."""
    def row(name, alphas, p, perplexity, fluent, best):
        return {"row": name, "alphas": alphas, "p": p, "perplexity": perplexity, "fluent": fluent, "best": best}

    rows = [row("kmeans:6", [0.0, 0.25, 0.5], [0.063, 0.011, 0.145], [3.0, 3.4, 5.2], [True] * 3, (0.5, 0.145)),
            row("diff-of-means", [0.0, 0.25, 0.5], [0.063, 0.026, 0.508], [3.0, 3.4, 6.6], [True, True, False],
                (0.0, 0.063)),
            row("random", [0.0, 0.25], [0.063, 0.064], [3.0, 3.9], [True, True], (0.25, 0.064)),
            row("prefix", [0.0], [0.395], [3.7], [True], (0.0, 0.395))]
    table = demo_steer.format_rows(rows, "sports").splitlines()
    assert table[3].endswith("0.063 at alpha 0 (unsteered)") and table[7].endswith("   0.395")  # a prefix: no alpha
    said = demo_steer.verdict(rows, "sports").splitlines()
    assert "diff-of-means: no alpha within the fluency budget raises P(sports); its 0.508 at alpha 0.5 is over the " \
           "budget (median perplexity 6.6), so its row is the unsteered continuations." in said
    assert sum("no alpha within" in line for line in said) == 1  # not the concept's, nor the control's


def test_batched_comparison_rows_equal_each_direction_and_prompt_swept_alone(setup):
    """compare() steers every direction in one batched, left-padded generation per alpha
    (`RowsAdd`); each row must be what a sweep of that direction's own `Add(v, scale="robust_norm")`
    gives, prompt by prompt (no padding, no other rows), up to the first alpha over the budget."""
    model, tok, lens = setup
    texts, labels = _texts()
    judge = TopicJudge(model, tok, texts, labels)
    g = torch.Generator().manual_seed(1)
    directions = {"a": torch.randn(model.config.hidden_size, generator=g),
                  "b": 3 * torch.randn(model.config.hidden_size, generator=g),
                  "c": _loud(model)}
    alphas = (0.0, 1.0, 4.0, 60.0)
    rows = demo_steer.compare(lens, tok, "blocks.1.resid_out", 1.0, directions, judge.topic("high"), "high",
                              PROMPTS, alphas=alphas, max_new_tokens=8)
    score = token_logprob(tok, [" high"])
    for row, (name, v) in zip(rows, directions.items()):
        edit = Add(v, 0.0, scale="robust_norm", norm=1.0, site="blocks.1.resid_out")
        alone = [sweep(lens, edit, alphas, [p], score, max_new_tokens=8, judge=judge.topic("high"), tokenizer=tok)
                 for p in PROMPTS]
        reached = len(row["alphas"])
        assert row["row"] == name and row["alphas"] == list(alphas[:reached])
        assert row["texts"] == [[r.texts[a][0] for r in alone] for a in range(reached)]
        judged = torch.stack([r.judged["P(high)"][:, 0] for r in alone], 1)
        torch.testing.assert_close(torch.tensor(row["scores"], dtype=torch.float64), judged[:reached],
                                   atol=1e-6, rtol=0, equal_nan=True)
        ppl = torch.stack([r.perplexity[:, 0] for r in alone], 1)
        torch.testing.assert_close(torch.tensor(row["perplexity"], dtype=torch.float64),
                                   ppl[:reached].nanquantile(0.5, dim=1), atol=0, rtol=1e-5, equal_nan=True)
        together = alone[0]._replace(scores=judged, perplexity=ppl, texts=[[""] * 3] * len(alphas),
                                     reference=ppl[0], judged={"P(high)": judged},
                                     repetition=torch.stack([r.repetition[:, 0] for r in alone], 1),
                                     reference_repetition=torch.stack([r.repetition[0, 0] for r in alone]))
        fluent = together.fluent  # the row stops right after its first alpha over the budget
        assert reached == (fluent.index(False) + 1 if False in fluent else len(alphas))
        best = best_within_budget(together, "P(high)")
        assert row["best"][0] == best[0] and row["best"][1] == pytest.approx(best[1], abs=1e-6)
    assert rows[0]["texts"][1] != rows[1]["texts"][1]  # the two directions did steer apart
    assert len(rows[2]["alphas"]) < len(alphas)  # the loud direction's loop (perplexity within 2x) left the sweep early


def _loud(model) -> torch.Tensor:
    """A direction that pushes one token's logit: at large alpha a loop of it, which the random
    model reads within 2x of its unsteered perplexity; the repetition budget breaks it."""
    return model.get_output_embeddings().weight[80].detach().clone()


def test_demo_candidates_are_each_sets_best_topic_probes_with_topic_contexts():
    """pick_concepts: per fitted set (never the random control), its `per_set` lowest topic probe
    losses among concepts whose top contexts are mostly topic documents, lowest loss first overall."""
    from types import SimpleNamespace

    labels = ["sport", "art", "sport", "art"]  # document -> label
    def described(losses, docs):  # concept j: probe loss for "sport" (column 1), top contexts in docs[j]
        return SimpleNamespace(stats={"probe_loss": torch.tensor([[9.0, x] for x in losses])},
                               info={"labels": ["art", "sport"]},
                               contexts=[{"contexts": [{"doc": d} for d in ds]} for ds in docs])

    descriptions = {"a": described([0.3, 0.1, 0.2, 0.5], [[0, 2], [1, 3], [0, 1, 2], [2]]),  # 1: art contexts
                    "b": described([0.4, 0.25], [[2], [0, 0, 1]]),
                    "random": described([0.0], [[0]])}
    assert demo_steer.pick_concepts(descriptions, labels, "sport", 2) == [
        ("a", 2, pytest.approx(0.2)), ("b", 1, pytest.approx(0.25)), ("a", 0, pytest.approx(0.3)),
        ("b", 0, pytest.approx(0.4))]
    assert demo_steer.pick_concepts(descriptions, labels, "sport", 1) == [("a", 2, pytest.approx(0.2)),
                                                                        ("b", 1, pytest.approx(0.25))]


def test_demo_screen_chooses_the_concept_and_the_random_control_alike_on_other_prompts(monkeypatch):
    """screen: one batched comparison on the screen prompts (none of the comparison's) at the screen
    alphas; the concept is the concept row steering furthest within the budget, the control the
    random row doing so (a random row's higher score never picks a concept, the prefix row is never
    the control); a row over the budget at every alpha loses to any within it."""
    seen = {}

    def fake_compare(lens, tok, site, norm, directions, judge, topic, prompts, alphas, max_new_tokens):
        seen.update(directions=list(directions), prompts=list(prompts), alphas=alphas, tokens=max_new_tokens)
        best = {"a:1": (0.5, 0.30), "b:2": None, "c:3": (0.75, 0.41), "random 0": (0.375, 0.90),
                "random 1": None, "random 2": (0.5, 0.20)}
        return [{"row": k, "best": best[k]} for k in directions] + [{"row": "prefix", "best": (0.0, 0.99)}]

    monkeypatch.setattr(demo_steer, "compare", fake_compare)
    v = torch.ones(4)
    concepts, randoms = {"a:1": v, "b:2": v, "c:3": v}, {"random 0": v, "random 1": v, "random 2": v}
    key, control, rows = demo_steer.screen(None, None, "s", 1.0, concepts, randoms, None, "sport",
                                           demo_steer.SCREEN_PROMPTS)
    assert (key, control) == ("c:3", "random 0") and len(rows) == 7
    assert seen["directions"] == [*concepts, *randoms] and seen["alphas"] == demo_steer.SCREEN_ALPHAS
    assert seen["tokens"] == demo_steer.SCREEN_TOKENS
    assert seen["prompts"] == list(demo_steer.SCREEN_PROMPTS)
    assert not set(demo_steer.SCREEN_PROMPTS) & set(demo_steer.PROMPTS)  # chosen on other prompts than scored on
    with pytest.raises(ValueError, match="share names"):
        demo_steer.screen(None, None, "s", 1.0, concepts, {"c:3": v}, None, "sport", ["p"])

    def over_budget(*args, **kwargs):
        return [{"row": k, "best": None} for k in args[4]] + [{"row": "prefix", "best": (0.0, 0.5)}]

    monkeypatch.setattr(demo_steer, "compare", over_budget)  # none within the budget: the first (the best probe)
    assert demo_steer.screen(None, None, "s", 1.0, concepts, randoms, None, "sport", ["p"])[:2] == ("a:1", "random 0")
