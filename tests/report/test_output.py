"""Where `write_report` / `conceptlens report --out` may write: a new or empty folder or an
earlier report; never the run folder, a folder above it, a symlink or anyone else's files."""

from __future__ import annotations

import json

import pytest

from conceptlens.cli import main
from conceptlens.report import write_report
from conceptlens.report.output import MANIFEST
from tests.report.atlas_fixture import write_fake_run

EXTRACTORS = [("topk", "topk-sae", 4), ("kmeans", "kmeans", 3)]


@pytest.fixture
def run(tmp_path):
    return write_fake_run(tmp_path / "run", EXTRACTORS, labels=False, steering=False)


def _tree(folder):
    """Every path under `folder`, but the run lock (runlock.py) a writer leaves in a run folder it locked."""
    from conceptlens.runlock import LOCK_FILE

    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.name != LOCK_FILE)


def _one_line_error(capsys, *needles):
    err = capsys.readouterr().err.strip()
    assert err.startswith("conceptlens report: error:") and "\n" not in err and "Traceback" not in err
    for needle in needles:
        assert needle in err, err


def test_a_folder_that_is_not_a_report_is_refused_and_kept(run, tmp_path, capsys):
    thesis = tmp_path / "somefolder"
    thesis.mkdir()
    (thesis / "thesis.tex").write_text("\\documentclass{article}")
    with pytest.raises(ValueError, match="is not a conceptlens report"):
        write_report(run, thesis)
    assert main(["report", str(run), "--out", str(thesis), "--no-progress"]) == 2
    _one_line_error(capsys, "is not a conceptlens report", str(thesis))
    assert _tree(thesis) == ["thesis.tex"] and (thesis / "thesis.tex").read_text() == "\\documentclass{article}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "somefolder"]  # no staging folder left


def test_the_run_folder_or_a_folder_above_it_is_refused(run, capsys):
    before = _tree(run)
    for out in (run, run.parent, run / "." / "..", run.parent.parent):
        assert main(["report", str(run), "--out", str(out), "--no-progress"]) == 2
        _one_line_error(capsys, "the run folder")
        with pytest.raises(ValueError, match="is the run folder .* or holds it"):
            write_report(run, out)
    assert _tree(run) == before


def test_symlinks_are_never_followed_for_writing(run, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (run / "report.partial").symlink_to(victim)  # the old code's fixed staging name
    (run / "report.old").symlink_to(victim)
    write_report(run)
    assert _tree(victim) == [] and (run / "report" / "index.html").is_file()
    assert not (run / "report").is_symlink()
    link = tmp_path / "link"
    link.symlink_to(victim)
    with pytest.raises(ValueError, match="is a symbolic link"):
        write_report(run, link)
    assert _tree(victim) == []


def test_an_earlier_report_is_replaced_by_its_own_files_only(run, tmp_path, capsys):
    out = tmp_path / "atlas"
    write_report(run, out)
    first = json.loads((out / MANIFEST).read_text())["files"]
    assert set(first) == {p for p in _tree(out) if (out / p).is_file()} - {MANIFEST}
    assert "concepts/kmeans/2.html" in first
    (run / "describe" / "kmeans" / "description.json").unlink()  # the next report has no kmeans pages
    assert main(["report", str(run), "--out", str(out), "--no-progress"]) == 0
    assert not (out / "concepts" / "kmeans").exists() and (out / "concepts" / "topk" / "3.html").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atlas", "run"]  # nothing aside or partial left
    (out / "concepts" / "notes.txt").write_text("mine")
    assert main(["report", str(run), "--out", str(out), "--no-progress"]) == 2
    _one_line_error(capsys, "'concepts/notes.txt'", "which no report wrote")
    assert (out / "concepts" / "notes.txt").read_text() == "mine" and (out / "index.html").is_file()


def test_an_earlier_report_with_a_symlink_inside_is_refused(run, tmp_path):
    out, victim = tmp_path / "atlas", tmp_path / "victim"
    write_report(run, out)
    victim.mkdir()
    (victim / "0.html").write_text("not the report's")
    for page in (out / "concepts" / "topk").iterdir():
        page.unlink()
    (out / "concepts" / "topk").rmdir()
    (out / "concepts" / "topk").symlink_to(victim)  # its manifest lists concepts/topk/0.html
    with pytest.raises(ValueError, match="'concepts/topk \\(a symbolic link\\)'"):
        write_report(run, out)
    assert (victim / "0.html").read_text() == "not the report's"


def test_an_empty_folder_is_used_and_a_failed_build_leaves_nothing(run, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    write_report(run, out)
    assert (out / "index.html").is_file()
    before = _tree(out)
    (run / "describe" / "topk" / "contexts.jsonl").write_text('{"concept": 3, "contexts": []}\n')
    with pytest.raises(ValueError, match="expected 0"):
        write_report(run, out)
    assert _tree(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["empty", "run"]


def test_a_foreign_extractor_folder_name_is_refused_in_one_line(run, capsys):
    (run / "describe" / "topk").rename(run / "describe" / "a'b")
    with pytest.raises(ValueError, match="extractor folder \"a'b\" is not a safe folder name"):
        write_report(run)
    assert main(["report", str(run), "--no-progress"]) == 2
    _one_line_error(capsys, "a'b")
    assert main(["report", str(run), "--out", ""]) == 2
    assert not (run / "report").exists()


def test_index_rows_carry_float32_statistics_exactly():
    """Rounded once, by the page: the index's figures are the concept pages' (no double rounding)."""
    import numpy as np

    from conceptlens.report.index_page import _clean

    values = np.random.default_rng(0).random(10_000).astype(np.float32) * np.float32(0.01)
    assert all(np.float32(_clean(v)) == v for v in values)
    assert f"{100 * _clean(np.float32(0.004955047)):.3g}" == f"{100 * float(np.float32(0.004955047)):.3g}" == "0.496"
    assert _clean(float("nan")) is None and _clean(3) == 3


@pytest.mark.parametrize("tokens, message", [
    (lambda t: t.update(promoted=t["promoted"][:2]), "promoted holds 2 lists; the description has 4 concepts"),
    (lambda t: t["suppressed"][1].append("one more"), r"suppressed\[1\] holds \d+ tokens; stats.safetensors has"),
    (lambda t: t["promoted"].__setitem__(3, [1, 2]), r"promoted\[3\] must be a list of token strings; got \[1, 2\]"),
    (lambda t: t.update(promoted="abc"), "promoted must be a list"),
])
def test_a_damaged_tokens_file_is_one_line_naming_it(run, capsys, tokens, message):
    path = run / "describe" / "topk" / "tokens.json"
    data = json.loads(path.read_text())
    tokens(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        write_report(run)
    assert main(["report", str(run), "--no-progress"]) == 2
    _one_line_error(capsys, str(path))


def test_a_hierarchy_with_a_cycle_is_one_line_naming_it(tmp_path, capsys):
    run = write_fake_run(tmp_path / "run", [("topk", "topk-sae", 6)], labels=False, steering=False, hierarchy="topk")
    path = run / "hierarchy" / "topk.json"
    data = json.loads(path.read_text())
    data["edges"].append({**data["edges"][0], "source": 3, "target": 0})  # 0 -> 1 -> 3 -> 0
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"its edges form a cycle \(0 -> 1 -> 3 -> 0\); a hierarchy is a DAG"):
        write_report(run)
    assert main(["report", str(run), "--no-progress"]) == 2
    _one_line_error(capsys, str(path), "cycle")
    assert not (run / "report").exists()


def test_an_empty_folder_of_the_users_inside_an_earlier_report_is_refused_and_kept(run, capsys):
    out = run / "report"
    write_report(run)
    (out / "my notes").mkdir()  # empty: a rebuild, which removes the folders it empties, would remove it
    assert main(["report", str(run), "--no-progress"]) == 2
    _one_line_error(capsys, "'my notes/ (an empty folder)'", "which no report wrote")
    assert (out / "my notes").is_dir()
    (out / "my notes").rmdir()
    for page in (out / "concepts" / "kmeans").iterdir():  # a report's own folder left empty is its own
        page.unlink()
    write_report(run)
    assert (out / "concepts" / "kmeans" / "0.html").is_file()


def test_a_set_of_no_concepts_links_to_no_page_and_a_run_given_as_dot_has_its_name_as_title(tmp_path, monkeypatch):
    from safetensors.numpy import save_file

    run = write_fake_run(tmp_path / "my-run", [("topk", "topk-sae", 4)], labels=False, steering=False)
    empty = run / "describe" / "none"
    empty.mkdir()
    meta = json.loads((run / "describe" / "topk" / "description.json").read_text())
    (empty / "description.json").write_text(json.dumps({**meta, "name": "none", "n_concepts": 0}))
    save_file({}, empty / "stats.safetensors")
    (empty / "contexts.jsonl").write_text("")
    monkeypatch.chdir(run)
    index = (write_report(".").path).read_text()
    assert "<title>Concept atlas: my-run" in index
    assert 'href="concepts/none/0.html"' not in index and 'href="concepts/topk/0.html"' in index
    assert "no concepts" in index


def test_a_report_of_another_run_is_not_replaced(run, tmp_path, capsys):
    other = write_fake_run(tmp_path / "other", EXTRACTORS, labels=False, steering=False, seed=1)
    out = tmp_path / "shared"
    write_report(run, out)
    before = _tree(out)
    assert main(["report", str(other), "--out", str(out), "--no-progress"]) == 2
    _one_line_error(capsys, f"holds the report of another run ({run.resolve()})", "give another --out")
    assert _tree(out) == before and json.loads((out / MANIFEST).read_text())["run"] == str(run.resolve())
    write_report(run, out)  # its own run's report is rebuilt there
    assert main(["report", str(other), "--no-progress"]) == 0  # and each run's own folder takes its own
