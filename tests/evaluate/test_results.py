"""`RUN/eval.json`: the suite's figures saved and read back, how a part run again merges, and the
per-concept probe scores (against scikit-learn) the concept pages show."""

import json
import math

import pytest
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler

from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.evaluate import results
from conceptlens.evaluate.bootstrap import Estimate
from conceptlens.evaluate.lines import Line
from conceptlens.evaluate.probing import binary_tasks, concept_probe_lines, probing_lines
from tests.evaluate.test_probing import _probed

SITE = "blocks.0.resid_out"


def _sets(run, sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, n in sizes.items():
        folder = run / "concepts" / name
        cs = ConceptSet(torch.randn(n, 8, generator=g), SITE, method="kmeans", model="tiny")
        cs.save(folder)
        out[name] = results.set_info(cs, folder, SITE, "cosine")
    return out


def _line(name, metric, value, concept=None):
    return Line(name, metric, Estimate(value, value - 0.05, value + 0.05),
                [("random 4 dirs", Estimate(0.6, 0.55, 0.65)), ("mean predictor", Estimate(1.0, math.nan, math.nan))],
                "a note", True, concept)


def _save(run, infos, part, lines, config=None, model="tiny"):
    p = results.Part(model, infos, SITE, part, config or {"ks": (1, 5), "progress": True}, 1.0)
    return results.save_part(run, p, lines, "95% intervals: a bootstrap")


def test_saved_figures_read_back_with_their_baselines_intervals_and_concepts(tmp_path):
    infos = _sets(tmp_path, {"a": 4, "b": 6})
    lines = [_line("a", "toy k=1 accuracy", 0.9), _line("b", "toy k=1 accuracy", 0.62), _line("a", "alone", 0.8, 3)]
    path = _save(tmp_path, infos, "probing toy", lines)
    data = json.loads(path.read_text())
    assert data["format"] == "conceptlens.Evaluation" and data["model"] == "tiny"
    assert data["sets"]["a"]["sha256"] == json.loads((tmp_path / "concepts/a/config.json").read_text())["sha256"]
    assert data["parts"] == [{"site": SITE, "part": "probing toy", "sets": ["a", "b"], "config": {"ks": [1, 5]},
                              "seconds": 1.0}]
    assert data["lines"][0]["baselines"][1] == ["mean predictor", [1.0, None, None]]  # NaN as null
    assert [r["verdict"] for r in data["lines"]] == ["wins", "overlaps", "wins"]
    back = results.load_results(tmp_path)
    assert back.sets == infos and back.interval == "95% intervals: a bootstrap"
    assert [_plain(sl.line) for sl in back.lines] == [_plain(ln) for ln in lines]
    assert {(sl.site, sl.part) for sl in back.lines} == {(SITE, "probing toy")}


def _plain(line):
    """A line with NaN as None (NaN != NaN)."""
    fix = lambda e: tuple(None if math.isnan(v) else v for v in e)  # noqa: E731
    return line._replace(value=fix(line.value), baselines=[(n, fix(e)) for n, e in line.baselines])


def test_a_part_run_again_replaces_only_its_own_figures(tmp_path):
    infos = _sets(tmp_path, {"a": 4, "b": 6})
    _save(tmp_path, infos, "probing toy", [_line("a", "toy", 0.9), _line("b", "toy", 0.7)])
    _save(tmp_path, infos, "reconstruction", [_line("a", "FVU", 0.3)])
    _save(tmp_path, {"a": infos["a"]}, "probing toy", [_line("a", "toy", 0.95)])  # same config, set a only
    got = {(sl.part, sl.line.extractor): sl.line.value.value for sl in results.load_results(tmp_path).lines}
    assert got == {("probing toy", "a"): 0.95, ("probing toy", "b"): 0.7, ("reconstruction", "a"): 0.3}
    _save(tmp_path, {"a": infos["a"]}, "probing toy", [_line("a", "toy", 0.5)], config={"ks": [2]})  # new config
    got = {(sl.part, sl.line.extractor): sl.line.value.value for sl in results.load_results(tmp_path).lines}
    assert got == {("probing toy", "a"): 0.5, ("reconstruction", "a"): 0.3}
    refit = _sets(tmp_path, {"a": 4}, seed=1)  # set a refitted: its earlier figures are about another set
    _save(tmp_path, refit, "absorption", [_line("a", "absorption", 0.1)])
    got = {(sl.part, sl.line.extractor) for sl in results.load_results(tmp_path).lines}
    assert got == {("absorption", "a")}


def test_a_file_of_another_model_or_one_that_does_not_read_is_refused_and_kept(tmp_path):
    infos = _sets(tmp_path, {"a": 4})
    path = _save(tmp_path, infos, "probing toy", [_line("a", "toy", 0.9)])
    before = path.read_bytes()
    message = r"holds figures of the model 'tiny', not 'other': pass --model 'tiny', or move it away"
    with pytest.raises(ValueError, match=message):
        results.check_file(tmp_path, "other")
    with pytest.raises(ValueError, match=message):
        _save(tmp_path, infos, "probing toy", [_line("a", "toy", 0.7)], model="other")
    results.check_file(tmp_path, "tiny")  # the same model merges
    path.write_bytes(before[:-40])  # cut short: it does not read
    with pytest.raises(ValueError, match=r"eval.json.*move it away to start a new file \(it is not replaced\)"):
        _save(tmp_path, infos, "probing toy", [_line("a", "toy", 0.7)])
    assert path.read_bytes() == before[:-40]
    path.unlink()
    results.check_file(tmp_path, "other")  # no file: any model starts one


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(format="x"), "format must be 'conceptlens.Evaluation'"),
    (lambda d: d["lines"][0].update(value=[0.5, 0.4]), r"lines\[0\]: value must be \[value, low, high\]"),
    (lambda d: d["lines"][0].update(concept=4), r"lines\[0\]: concept must be an integer or null in \[0, 3\]; got 4"),
    (lambda d: d["lines"][0].update(extractor="zz"), r"extractor 'zz' is not one of the sets \['a'\]"),
    (lambda d: d["lines"][0].update(metric=["<b>"]), r"lines\[0\]: metric must be a string"),
    (lambda d: d["sets"]["a"].update(n_concepts="4"), r"sets\['a'\]: n_concepts must be an integer"),
])
def test_a_malformed_file_is_refused_in_one_line_naming_the_field(tmp_path, edit, message):
    _save(tmp_path, _sets(tmp_path, {"a": 4}), "probing toy", [_line("a", "toy", 0.9, 1)])
    data = json.loads((tmp_path / "eval.json").read_text())
    edit(data)
    (tmp_path / "eval.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        results.load_results(tmp_path)


def test_each_concept_alone_is_sklearns_one_feature_probe_next_to_the_tasks_controls():
    train, test = _probed(0), _probed(1)
    lines = concept_probe_lines("toy", train, test, ["a", "b"], top=3)
    assert [ln.concept for ln in lines][0] == 5 and len(lines) == 3  # the planted latent ranks first
    (task,) = binary_tasks(train.y, test.y, ["a", "b"])
    z_train, z_test = train.z["planted"][task.train].double().numpy(), test.z["planted"][task.test].double().numpy()
    for ln in lines:
        col = [ln.concept]
        scaler = StandardScaler().fit(z_train[:, col])
        ref = LogisticRegression(C=1.0, max_iter=1000).fit(scaler.transform(z_train[:, col]), task.y_train.numpy())
        expected = (ref.predict(scaler.transform(z_test[:, col])) == task.y_test.numpy()).mean()
        assert ln.value.value == pytest.approx(expected) and ln.value.low <= ln.value.value <= ln.value.high
        assert [name for name, _ in ln.baselines] == ["random 32 dirs, best 1", "diff-of-means"]
    k1 = probing_lines("toy", train, test, ["a", "b"], ks=(1,))[0]
    assert lines[0].value == k1.value  # rank 1 alone is the k = 1 probe
    assert lines[0].baselines[0][1] == k1.baselines[0][1] and lines[0].baselines[1][1] == k1.baselines[1][1]
    assert lines[0].note == "rank 1 of 32 by mean difference (higher on b)"


def test_a_part_run_again_on_some_sets_keeps_the_others_when_only_other_parts_settings_changed(tmp_path):
    from conceptlens.evaluate.suite import SuiteConfig, part_config

    infos = _sets(tmp_path, {"a": 4, "b": 6})
    first = SuiteConfig(suites=("probing",), tasks=("bbc-news",))
    _save(tmp_path, infos, "probing bbc-news", [_line("a", "toy", 0.9), _line("b", "toy", 0.7)],
          config=part_config(first, "probing bbc-news"))
    # another task list, other parts and their settings: the bbc-news probing settings are the same
    again = SuiteConfig(suites=("probing", "absorption"), tasks=("bbc-news", "movie-polarity"), absorption_words=50,
                        recon_docs=8, progress=True)
    assert part_config(again, "probing bbc-news") == part_config(first, "probing bbc-news")
    _save(tmp_path, {"a": infos["a"]}, "probing bbc-news", [_line("a", "toy", 0.95)],
          config=part_config(again, "probing bbc-news"))
    got = {sl.line.extractor: sl.line.value.value for sl in results.load_results(tmp_path).lines}
    assert got == {"a": 0.95, "b": 0.7}  # b's figures stay: they were measured with the same settings
    changed = SuiteConfig(suites=("probing",), tasks=("bbc-news",), ks=(1, 2))
    assert part_config(changed, "probing bbc-news") != part_config(first, "probing bbc-news")
    assert part_config(changed, "reconstruction") == part_config(first, "reconstruction")  # ks: not its setting
    assert "concept_top" in part_config(first, "probing bbc-news")  # the report reads it from the part's config
