"""The static report: layout, links that resolve, escaping, matching, errors, CLI."""

from __future__ import annotations

import itertools
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from conceptlens.cli import main
from conceptlens.report import Atlas, write_report
from conceptlens.report.concept_page import top_tokens
from conceptlens.report.matching import match_directions
from tests.report.atlas_fixture import write_fake_run

EXTRACTORS = [("topk", "topk-sae", 12), ("kmeans", "kmeans", 8), ("deleuzian", "deleuzian", 8)]


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        for key, value in attrs:
            if key in ("href", "src") and value:
                self.links.append(value)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    run = write_fake_run(tmp_path_factory.mktemp("atlas") / "run", EXTRACTORS, hierarchy="topk")
    write_report(run)
    return run / "report"


def test_layout_one_page_per_concept(report):
    for name, _, n in EXTRACTORS:
        assert sorted(p.name for p in (report / "concepts" / name).iterdir()) == sorted(f"{i}.html" for i in range(n))
    for rel in ("index.html", "matches.html", "hierarchy/topk.html", "static/style.css", "static/atlas.js",
                "static/atlas-data.js"):
        assert (report / rel).is_file(), rel


def test_every_link_resolves_and_nothing_is_remote(report):
    pages = list(report.rglob("*.html"))
    for page in pages:
        parser = _Links()
        parser.feed(page.read_text())
        for link in parser.links:
            assert not re.match(r"^[a-z]+://|^//", link), f"{page}: remote link {link}"
            target = link.split("#")[0]
            if target:
                assert (page.parent / target).resolve().is_file(), f"{page}: broken link {link}"
    css_js = (report / "static" / "style.css").read_text() + (report / "static" / "atlas.js").read_text()
    assert "http://" not in css_js.replace("http://www.w3.org/2000/svg", "") and "https://" not in css_js


def test_index_data_lists_every_concept(report):
    text = (report / "static" / "atlas-data.js").read_text()
    data = json.loads(text[text.index("=") + 1:].rstrip().rstrip(";"))
    ex_idx, c_idx = data["columns"].index("ex"), data["columns"].index("concept")
    got = sorted((data["extractors"][r[ex_idx]]["name"], r[c_idx]) for r in data["rows"])
    assert got == sorted((name, i) for name, _, n in EXTRACTORS for i in range(n))


def test_concept_page_content(report, tmp_path):
    run = report.parent
    atlas = Atlas.load(run)
    ex = atlas.extractor("topk")
    contexts = list(ex.contexts())
    html = (report / "concepts" / "topk" / "1.html").read_text()
    # each top context appears with its tokens shaded, centre marked
    assert html.count('class="ctx"') == len(contexts[1])
    assert html.count('class="c"') == len(contexts[1])
    # neighbours by direction are links to the stored indices
    for j in ex.stats["nearest_direction"][1]:
        assert f'href="../topk/{j}.html"' in html
    # probe loss per class vs base rate; steering sample text is escaped
    assert "base-rate entropy" in html and "politics" in html
    assert "text at alpha 0.5 &lt;b&gt;" in html and "<b>" not in html
    # promoted tokens of a decoder, none for k-means
    assert "Promoted tokens" in html
    assert "Promoted tokens" not in (report / "concepts" / "kmeans" / "0.html").read_text()
    # hierarchy family: 1 is the child of 0 and parent of 3, 4
    assert 'href="../topk/0.html"' in html.split("parents:")[1].split("children:")[0]
    # the captions explain what the page shows: no assigned share without one, no zero line not drawn
    assert "Frequency: share" in html and "Assigned:" not in html and "assigned" not in ex.stats
    assert ex.stats["hist_edges"][1][0] == 0 and "stroke-dasharray" not in html and "dashed line" not in html


@pytest.mark.parametrize("positions, said", [("all", "at every position"),
                                              ("generated", "at the generated tokens only"), (None, "")])
def test_steering_caption_names_the_positions_the_samples_were_steered_at(tmp_path, positions, said):
    """describe's samples steer every position, the demo's only the generated tokens: the caption
    says which; samples written before they recorded it claim neither."""
    run = write_fake_run(tmp_path / "run", [("topk", "topk-sae", 4)], labels=False)
    path = run / "describe" / "topk" / "description.json"
    info = json.loads(path.read_text())
    if positions is not None:
        info["steering"][0]["positions"] = positions
    path.write_text(json.dumps(info))
    write_report(run, progress=False)
    html = (run / "report" / "concepts" / "topk" / "1.html").read_text()
    caption = re.search(r"<h2>Steering</h2>.*?<figcaption[^>]*>(.*?)</figcaption>", html, re.S)[1]
    assert caption.startswith("The prompt continued greedily") and "{where}" not in caption
    assert (said in caption) if said else ("every position" not in caption and "generated" not in caption)


def test_top_tokens_counts_centres():
    ctx = [{"tokens": ["a", " goal"], "center": 1}, {"tokens": [" cup", "x"], "center": 0},
           {"tokens": [" goal"], "center": 0}]
    assert top_tokens(ctx) == ["goal", "cup"]
    blank = [{"tokens": [" "], "center": 0}, {"tokens": ["\n\n"], "center": 0}, {"tokens": ["  "], "center": 0},
             {"tokens": [" "], "center": 0}]  # whitespace tokens are shown, not left blank
    assert top_tokens(blank) == ["\u2423", "\u21b5\u21b5", "\u2423\u2423"]


def test_matching_is_the_best_assignment():
    rng = np.random.default_rng(3)
    a = rng.normal(size=(5, 6))
    b = rng.normal(size=(5, 6))
    a /= np.linalg.norm(a, axis=1, keepdims=True)
    b /= np.linalg.norm(b, axis=1, keepdims=True)
    cos = a @ b.T
    best = max(itertools.permutations(range(5)), key=lambda p: sum(cos[i, p[i]] for i in range(5)))
    m = match_directions(a, b)
    assert dict(zip(m.rows.tolist(), m.cols.tolist())) == dict(enumerate(best))
    assert np.all(np.diff(m.cos) <= 0)
    np.testing.assert_allclose(m.best_ab_cos, cos.max(1))


def test_matches_page_pairs_same_site_only(tmp_path):
    run = write_fake_run(tmp_path / "run", EXTRACTORS[:2])
    write_report(run)
    html = (run / "report" / "matches.html").read_text()
    assert "topk &harr; kmeans" in html or "kmeans &harr; topk" in html
    # a copy of topk's directions is matched to itself with cosine 1
    import shutil
    shutil.copytree(run / "concepts" / "topk", run / "concepts" / "topk2")
    shutil.copytree(run / "describe" / "topk", run / "describe" / "topk2")
    write_report(run)
    html = (run / "report" / "matches.html").read_text()
    rows = re.findall(r'topk2?/(\d+)\.html">topk2? #\d+</a>.*?topk2?/(\d+)\.html.*?<td class="num">([\d.]+)</td>', html)
    assert any(cos == "1" for _, _, cos in rows)


def test_no_description_is_a_clear_error_that_names_the_command_to_run(tmp_path, capsys):
    import torch

    from conceptlens import ConceptSet

    run = tmp_path / "run"
    run.mkdir()
    assert main(["report", str(run)]) == 2
    assert "is no run folder: a report shows a run folder that `conceptlens fit` wrote" in capsys.readouterr().err
    (run / "run.toml").write_text('model = "smollm2-135m"\n')
    assert main(["report", str(run)]) == 2
    assert f"run `conceptlens describe {run}` first" in capsys.readouterr().err
    ConceptSet(torch.randn(2, 4), site="blocks.0.resid_out").save(run / "concepts" / "km")
    assert main(["report", str(run / "concepts" / "km")]) == 2  # suggested describe, which takes runs only
    err = capsys.readouterr().err
    assert f"is a concept set of the run {run}: `conceptlens report {run}` shows it" in err and err.count("\n") == 1
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "no run folder" in capsys.readouterr().err


def test_bad_contexts_order_is_named(tmp_path):
    run = write_fake_run(tmp_path / "run", EXTRACTORS[1:2])
    path = run / "describe" / "kmeans" / "contexts.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")
    with pytest.raises(ValueError, match="concept 1.*expected 0"):
        write_report(run)
    assert not (run / "report").exists()


def test_a_damaged_stats_file_is_one_line(tmp_path, capsys):
    run = write_fake_run(tmp_path / "run", EXTRACTORS[1:2])
    path = run / "describe" / "kmeans" / "stats.safetensors"
    path.write_bytes(path.read_bytes()[:1000])  # cut short
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert str(path) in err and "run describe again" in err and "\n" not in err
    assert not (run / "report").exists()


@pytest.mark.parametrize("cut", [slice(0, 1), slice(None)])  # too few lines; one too many (added below)
def test_a_contexts_file_of_another_length_is_one_line(tmp_path, capsys, cut):
    run = write_fake_run(tmp_path / "run", EXTRACTORS[1:2])
    path = run / "describe" / "kmeans" / "contexts.jsonl"
    lines = path.read_text().splitlines()[cut]
    if cut == slice(None):
        lines.append('{"concept": %d, "contexts": []}' % len(lines))
    path.write_text("\n".join(lines) + "\n")
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert str(path) in err and "n_concepts" in err and "\n" not in err and "Traceback" not in err
    assert not (run / "report").exists()


def test_cli_writes_report_and_replaces_old(tmp_path, capsys):
    run = write_fake_run(tmp_path / "run", EXTRACTORS[:1], labels=False, steering=False)
    write_report(run)
    (run / "report" / "matches.html").write_text("old")
    assert main(["report", str(run), "--no-progress"]) == 0
    assert "index.html" in capsys.readouterr().out
    assert "old" != (run / "report" / "matches.html").read_text() and (run / "report" / "index.html").is_file()
    html = (run / "report" / "concepts" / "topk" / "0.html").read_text()
    assert "Probe loss" not in html and "Steering" not in html


def test_histogram_bars_span_their_bins_and_show_density():
    from conceptlens.report.histogram import histogram_svg

    svg = histogram_svg(np.array([-1.0, 0.0, 1.0, 3.0]), np.array([4, 0, 8]), width=412)  # plot width 400
    bars = [tuple(float(v) for v in m) for m in re.findall(r'<rect x="([\d.]+)" y="[\d.]+" width="([\d.]+)" '
                                                            r'height="([\d.]+)"', svg)]
    (x0, w0, h0), (x1, w1, h1) = bars  # the empty bin draws nothing
    assert (x0, w0) == (6.0, 100.0) and (x1, w1) == (206.0, 200.0)  # at their real widths on a linear axis
    assert h0 == pytest.approx(h1)  # 4 tokens over 1 and 8 over 2: the same density
    assert 'stroke-dasharray' in svg  # the zero line


def test_controls_and_duplicates(tmp_path):
    from conceptlens.report.quality import duplicates, quality_rows

    run = write_fake_run(tmp_path / "run", [("kmeans", "kmeans", 8), ("random", "random", 20)])
    atlas = Atlas.load(run)
    assert [e.name for e in atlas.extractors] == ["kmeans"] and [c.name for c in atlas.controls] == ["random"]
    rows = dict(quality_rows(atlas, {"kmeans": ["a"] * 8}))
    control = rows["control: random, best of 8 (for kmeans)"]
    loss = atlas.controls[0].stats["probe_loss"]
    assert control["probe sport"] == pytest.approx(float(loss[:8, 3].min()))  # best of the first 8, not of 20
    assert rows["kmeans"]["top token"] == "'a' heads 8/8"
    ex = atlas.extractors[0]
    ex.stats["nearest_direction_cos"][3, 0] = 0.995
    assert [i for i, d in enumerate(duplicates(ex)) if d] == [3]


def test_the_extractors_table_shows_the_tokens_each_set_was_fed(tmp_path):
    """A set fitted on a budget of its own (config.fit.tokens, as `fit` records it) shows its tokens
    beside a set fed the whole pass; a set whose config records none shows an empty cell."""
    from conceptlens.concepts.conceptset import ConceptSet

    run = write_fake_run(tmp_path / "run", EXTRACTORS)
    for name, tokens in (("topk", 40_960), ("kmeans", 81_920)):
        cs = ConceptSet.load(run / "concepts" / name)
        cs.config["fit"] = {"tokens": tokens}
        cs.save(run / "concepts" / name)
    from safetensors.numpy import load_file, save_file

    stats_path = run / "describe" / "topk" / "stats.safetensors"
    stats = load_file(stats_path)
    stats["frequency"][[1, 4]] = 0.0  # two latents that never fired on the described text
    save_file(stats, stats_path)
    write_report(run)
    atlas = Atlas.load(run)
    assert [atlas.extractor(n).fit_tokens for n in ("topk", "kmeans", "deleuzian")] == [40_960, 81_920, None]
    html = (run / "report" / "index.html").read_text()
    rows = re.findall(r"<tr>(.*?)</tr>", html[html.index("<h2>Extractors</h2>"):], re.S)
    cells = {re.sub("<[^>]+>", "", r.split("</td>")[0]).strip(): r for r in rows[1:4]}
    assert "40,960" in cells["topk"] and "81,920" in cells["kmeans"] and "fit tokens" in rows[0]
    heads = re.findall(r"<th[^>]*>(.*?)</th>", rows[0])
    for name, row in cells.items():  # the concepts active on no described token, counted from the stats
        silent = int((atlas.extractor(name).stats["frequency"] == 0).sum())
        cols = [re.sub("<[^>]+>", "", c).strip() for c in row.split("</td>")]
        assert cols[heads.index("never active")] == f"{silent:,}"
    assert int((atlas.extractor("topk").stats["frequency"] == 0).sum()) >= 2


def test_co_activation_neighbours_with_a_zero_score_are_not_listed(tmp_path):
    """A latent that never fired has a co-activation score of 0 with every other: listing them (in index
    order) showed neighbours that never fire with it."""
    from safetensors.numpy import load_file, save_file

    run = write_fake_run(tmp_path / "run", [("topk", "topk-sae", 12)])
    path = run / "describe" / "topk" / "stats.safetensors"
    stats = load_file(path)
    stats["nearest_coact_score"][2] = 0.0  # concept 2 fired with none
    stats["nearest_coact_score"][3, 1:] = 0.0  # concept 3 with one only
    save_file(stats, path)
    write_report(run)

    def listed(i: int) -> list[str]:
        html = (run / "report" / "concepts" / "topk" / f"{i}.html").read_text()
        block = html.split("Nearest by co-activation")[1].split("</ol>")[0]
        return re.findall(r"<li>(.*?)</li>", block, re.S)

    assert listed(2) == ["none with a Jaccard score above 0"]
    assert len(listed(3)) == 1 and f'href="../topk/{stats["nearest_coact"][3, 0]}.html"' in listed(3)[0]
    assert len(listed(4)) == stats["nearest_coact"].shape[1]


def test_a_link_to_a_concept_without_contexts_says_so():
    from conceptlens.report.concept_page import concept_link

    labels = {"topk": ["the, a", ""]}  # a label is empty only when the concept has no contexts
    assert concept_link("topk", 0, labels).endswith('<span class="muted">the, a</span>')
    assert concept_link("topk", 1, labels, " (0.162)").endswith('<span class="muted">no contexts (0.162)</span>')
