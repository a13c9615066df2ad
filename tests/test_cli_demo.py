"""`conceptlens demo` end to end on a tiny random Llama folder with small budgets."""

from __future__ import annotations

import argparse
import json
import math
import re

import pytest

from conceptlens.cli import main
from conceptlens.commands import run_config as rc
from conceptlens.commands.demo import (DENSE_CONCEPTS, SHORT_FIT_K, SHORT_FIT_WIDTH, add_arguments, pools_documents,
                                       run_config, sae_batch_size)
from conceptlens.commands.demo_probe import PART
from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.concepts.sae.config import short_budget_lr
from conceptlens.evaluate.lines import verdict
from conceptlens.evaluate.results import load_results
from tests.tiny_folder import save_tiny_llama


def test_sae_batch_scales_with_the_budget():
    assert sae_batch_size(3_000) == 128
    assert sae_batch_size(40_000) == 128
    assert sae_batch_size(10_000_000) == 4096
    for tokens in (40_000, 80_000, 200_000, 1_200_000):
        assert tokens // sae_batch_size(tokens) >= 300


def test_the_demos_sae_takes_its_multiple_of_the_lr_fit_chooses_for_its_budget(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path / "run")])  # defaults: 80k tokens, the SAE's 40k, width 2048, k 8
    cfg = run_config(args)
    topk = next(e for e in cfg.extractors if e["name"] == "topk")
    assert (topk["width"], topk["k"], topk["batch_size"]) == (2048, 8, 128)
    assert cfg.fit.max_tokens == 80_000 and rc.extractor_tokens(cfg) == {"topk": 40_000}  # the dense sets read all
    short = run_config(parser.parse_args(["--max-tokens", "20000", "--out", str(tmp_path / "run")]))
    assert rc.extractor_tokens(short) == {} and next(e for e in short.extractors if e["name"] == "topk")["lr"] == \
        2 * short_budget_lr(2048, 20_000 // 128, 128)  # a pass shorter than the SAE's budget: the pass's
    assert topk["lr"] == 2 * short_budget_lr(2048, 40_000 // 128, 128)
    # 2 x 2e-4 sqrt(16384 / 2048) x sqrt(16000 / 312) x 128 / 384: 2.7e-3
    assert topk["lr"] == pytest.approx(2 * 2e-4 * 8 ** 0.5 * (16000 / 312) ** 0.5 / 3, rel=1e-12)


def test_dense_sets_fit_document_means_when_the_budget_holds_a_document_per_concept(tmp_path):
    assert pools_documents(40_000, 128)  # 312+ documents of <= 128 tokens
    assert pools_documents(128 * 128, 128)
    assert not pools_documents(128 * 128 - 1, 128)  # fewer documents than concepts: tokens
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for tokens, unit in (("40000", "document"), ("4095", None)):  # 31 documents for 32 concepts: tokens
        specs = {e["name"]: e for e in run_config(parser.parse_args(["--max-tokens", tokens, "--out", str(tmp_path / "run")])).extractors}
        assert specs["kmeans"].get("unit") == specs["deleuzian"].get("unit") == unit
        assert specs["deleuzian"].get("mode") == ("paper" if unit else None)
        # over document means the skewed differences are the topics: no 1 / |skewness| weights
        assert specs["deleuzian"].get("skew_weighting", True) is (unit is None)
        assert specs["deleuzian"]["n_concepts"] == specs["kmeans"]["n_concepts"] == 32


def test_probes_learn_outside_the_fit_and_say_so_when_a_large_fit_leaves_too_few_articles():
    from conceptlens.commands.demo_probe import probe_skip

    assert probe_skip(320, 240, 1781) == (320, " outside the fit")
    assert probe_skip(1700, 240, 1781) == (1541, " (159 of them read by the fit, which read 1700)")
    assert probe_skip(0, 240, 1781) == (0, "")


def test_demo_writes_every_part_of_the_run(tmp_path, capsys):
    model = save_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "run"
    code = main(["demo", "--model", str(model), "--site", "blocks.1.resid_out", "--max-tokens", "3000",
                 "--describe-tokens", "3000", "--concepts", "8", "--width", "64", "--k", "4", "--out", str(out),
                 "--no-progress", "--judge-model", str(model), "--probe-docs", "60", "460", "--probe-draws", "2",
                 "--ce-docs", "4"])
    printed = capsys.readouterr().out
    assert code == 0
    for part in ("run.toml", "fit_report.json", "quality.json", "report/index.html", "report/matches.html",
                 "report/concepts/topk/63.html", "report/concepts/deleuzian/7.html"):
        assert (out / part).is_file(), part
    assert not (out / "report" / "concepts" / "random").exists()  # the control is a table row, not concepts
    quality = json.loads((out / "quality.json").read_text())
    assert set(quality["extractors"]) == {"deleuzian", "topk", "kmeans", "random/8", "random/64"}  # matched in count
    assert "FVU" in quality["extractors"]["topk"] and "FVU" not in quality["extractors"]["kmeans"]
    from conceptlens.report import Atlas
    from conceptlens.report.quality import quality_rows

    shown = dict(quality_rows(Atlas.load(out), {}))  # the atlas's quality table: the console's figure
    for name in ("deleuzian", "topk", "kmeans"):
        assert shown[name]["effective rank"] == pytest.approx(quality["extractors"][name]["effective rank"], rel=1e-5)
    assert "Deleuzian 8 concepts (paper mode on document means, no skew weighting)" in printed
    assert "k-means 8 (on document means, tokens assigned to the nearest)" in printed
    assert (out / "run.toml").read_text().count('unit = "document"') == 2  # Deleuzian and k-means
    assert "base-rate entropy" in printed and "of kept tokens carry" in printed and "optimiser steps" in printed
    table = printed[printed.index("k = 5 sparse probe per topic"):printed.index("Reconstruction spliced")]
    assert "probes fitted on 60 train-split articles outside the fit" in table
    scored = re.search(r"scored on (\d+) test-split articles and (\d+) train-split articles, none a text the fit or "
                       r"the probes read", table)  # more than the test split's 444 (less any repeat of a read text)
    assert scored and int(scored[1]) <= 444 and int(scored[1]) + int(scored[2]) == 460
    for topic in ("business", "entertainment", "politics", "sports", "tech"):
        assert f"  {topic} k=5 accuracy" in table
    assert sum(line.strip() == "matched random" or line.strip().startswith("matched random ")
               for line in table.splitlines()) == 5
    for name in ("deleuzian", "topk", "kmeans"):
        assert f"\n{name}: " in table  # the plain verdict per set
        assert table.count(f"\n{name}: ") == 2  # and again for the other reading
    assert "(--probe-read activation):" in table  # codes by default, the other reading summed up after
    recon = printed[printed.index("Reconstruction spliced"):]
    assert "| topk | CE loss recovered |" in recon and "mean-ablation" in recon and "zero-ablation" in recon
    if "no steering example" not in printed:
        table = printed[printed.index("best within budget\n"):]
        rows = table.splitlines()[1:9:2]  # each row: a P(sports) line, then a perplexity line
        assert "held-out accuracy" in printed and all(" P(sports) " in row for row in rows)
        held = re.search(r"held-out accuracy [\d.]+ on (\d+) test articles \(none a copy of one it learned on\)",
                         printed)
        assert held and int(held[1]) < 444  # the test split repeats some of the 600 train articles it learned on
        for row, name in zip(rows, ("deleuzian:", "diff-of-means", "random", "prefix 'Write about sports.'")):
            assert row.startswith(name) or (name == "deleuzian:" and row.split()[0].split(":")[0] in
                                            ("topk", "kmeans")), (row, name)
        assert "Highest point value within the fluency budget:" in table or "No row raises P(sports)" in table
        screen = printed[printed.index("Choosing the steered concept on 8 prompts"):
                         printed.index("best within budget\n")]
        chosen = re.search(r"chosen: (\S+(?: centred)?) and (random \d+)", screen)
        assert chosen and rows[0].startswith(chosen[1] + " ") and f"{chosen[2]} (row \"random\")" in screen
        assert json.loads((out / "steering.json").read_text())["judge_accuracy"] > 0
    # the printed figures are the atlas's too: RUN/eval.json holds them as parts of the suite's table
    saved = load_results(out)
    parts = {p["part"] for p in saved.parts}
    assert {PART, "demo: reconstruction"} <= parts
    lines = [sl.line for sl in saved.lines if sl.part == PART]
    probe = [ln for ln in lines if ln.metric.endswith(", codes")]  # the printed table's reading
    assert len(probe) == 15 and {ln.extractor for ln in probe} == {"deleuzian", "topk", "kmeans"}
    assert all(f"{ln.value.value:.3f} [{ln.value.low:.3f}, {ln.value.high:.3f}] {verdict(ln)}" in printed
               for ln in probe)  # the printed table's cells, verdicts included
    other = [ln for ln in lines if ln not in probe]  # the other reading, whose verdicts the demo sums up
    assert len(other) == 15 and all(ln.metric.endswith(" k=5 accuracy") for ln in other)
    after = printed[printed.index("(--probe-read activation):"):]
    for name in ("deleuzian", "topk", "kmeans"):  # the saved lines are the ones the printed verdicts sum up
        missed = [ln.metric.split()[0] for ln in other if ln.extractor == name and verdict(ln) != "wins"]
        said = next(line for line in after.splitlines() if line.startswith(f"{name}: "))
        assert ("every topic" in said) if not missed else \
            (f"on {len(missed)} of 5 topics: " in said and all(f"{t} (" in said for t in missed)), said
    index = (out / "report" / "index.html").read_text()
    assert "<h2>Evaluation suite</h2>" in index and PART in index and "demo: reconstruction" in index
    if "no steering example" not in printed:
        steered = [sl.line for sl in saved.lines if sl.part == "demo: steering toward sports"]
        page = next(ln for ln in steered if ln.concept is not None)
        assert page._replace(concept=None) == steered[0]
        assert [name for name, _ in page.baselines] == ["random direction", "diff-of-means", "prompt prefix"]
        assert not math.isnan(page.value.low)  # alpha 0 is always within the budget: the concept has a best
        for est in (page.value, *(e for _, e in page.baselines)):  # the printed best cells carry the saved intervals
            assert math.isnan(est.low) or f"{est.value:.3f} [{est.low:.3f}, {est.high:.3f}]" in printed
        assert "each the best of 6 on 8 screen prompts" in page.note
        html = (out / "report" / "concepts" / page.extractor / f"{page.concept}.html").read_text()
        assert "<h2>Evaluation suite: this concept's scores</h2>" in html
        assert "steer bbc-news sports: P(sports)" in html
        assert "P(sports) minus diff-of-means" in html and "P(sports) minus random" in html  # the paired verdicts
    assert "Open:" in printed and (out / "report" / "index.html").resolve().as_uri() in printed


def test_bad_topic_fails_before_the_model_loads(capsys, monkeypatch):
    from conceptlens import models
    from conceptlens.commands.demo_steer import SCREEN_PROMPTS

    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["demo", "--topic", "cooking"]) == 2
    err = capsys.readouterr().err
    assert "cooking" in err and "sports" in err and "Traceback" not in err
    # a prompt the steered concept is chosen on would score the choice on its own prompt
    assert main(["demo", "--prompt", "Hello there", SCREEN_PROMPTS[3]]) == 2
    err = capsys.readouterr().err
    assert f"--prompt {SCREEN_PROMPTS[3]!r} is one of the prompts" in err and "Traceback" not in err
    assert main(["demo", "--max-tokens", "0"]) == 2
    assert "--max-tokens" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--width", "--k"])
def test_bad_sizes_are_named(flag, capsys):
    args = ["demo", "--k", "64", "--width", "32"] if flag == "--k" else ["demo", flag, "-1"]
    assert main(args) == 2
    assert flag in capsys.readouterr().err


def _demo_args(model, out, *more):
    return ["demo", "--model", str(model), "--site", "blocks.1.resid_out", "--max-tokens", "3000", "--describe-tokens",
            "3000", "--concepts", "8", "--width", "64", "--k", "4", "--out", str(out), "--no-progress", "--judge-model",
            str(model), "--probe-docs", "60", "460", "--probe-draws", "2", "--ce-docs", "4", *more]


def _held_run(out, *more):
    """A folder holding the run of another seed: its run.toml, a set and a file of the user's."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    (out / "concepts" / "old").mkdir(parents=True)
    (out / "run.toml").write_text(rc.to_toml(run_config(parser.parse_args(["--out", str(out), "--seed", "1", *more]))))
    (out / "concepts" / "old" / "config.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    return _files(out)


def _files(out):
    return {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".conceptlens.lock"}


def test_a_folder_holding_another_run_is_refused_before_the_model_loads_and_left_as_it_was(tmp_path, capsys,
                                                                                         monkeypatch):
    from conceptlens import models

    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "run"
    before = _held_run(out)
    assert main(["demo", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out} holds a run with another shuffle (1, now 0); use another --out, or --overwrite" in err
    assert err.count("\n") == 1 and _files(out) == before
    assert main(["demo", "--out", str(tmp_path / "new"), "--judge-model", "no-such-judge"]) == 2
    assert "unknown model 'no-such-judge'" in capsys.readouterr().err  # not after the fit, at the steering step


def test_overwrite_clears_the_run_the_folder_held_once_the_site_is_checked(tmp_path, capsys):
    model = save_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "run"
    before = _held_run(out, "--model", str(model), "--site", "blocks.1.resid_out")
    assert main(_demo_args(model, out, "--overwrite", "--site", "blocks.9.resid_out")) == 2
    assert "blocks.9" in capsys.readouterr().err
    assert _files(out) == before  # a bad site loses nothing
    assert main(_demo_args(model, out, "--overwrite", "--site", "blocks.1.attn.pattern")) == 2
    assert "width grows with the sequence" in capsys.readouterr().err
    assert _files(out) == before  # nor does a site no extractor can fit (it wrote run.toml, then failed)
    assert main(_demo_args(model, out)) == 2  # without --overwrite: refused
    assert "holds a run with another shuffle (1, now 0)" in capsys.readouterr().err
    assert main(_demo_args(model, out, "--overwrite")) == 0
    assert "--overwrite: removed the 2 files of the run" in capsys.readouterr().out
    assert (out / "notes.txt").read_text() == "mine" and not (out / "concepts" / "old").exists()
    assert rc.read_toml(out / "run.toml")["shuffle"] == 0 and (out / "concepts" / "topk").is_dir()
    assert main(_demo_args(model, out)) == 0  # the same run again: it resumes
    assert "(0 after resuming at 4,096)" in capsys.readouterr().out
    assert not (out / "describe" / "checkpoint.pt").exists()  # the pass is done: no checkpoint of it is left
    assert rc.read_toml(out / "run.toml")["model"] != ConceptSet.load(out / "concepts" / "random").model == \
        ConceptSet.load(out / "concepts" / "topk").model == "tiny"  # a folder is named by its last part
    assert main(["describe", str(out), "--top-n", "3"]) == 0  # redescribed with other options, from the start
    assert json.loads((out / "describe" / "topk" / "description.json").read_text())["top_n"] == 3


def test_help_shows_every_default(capsys):
    assert main(["demo", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--max-tokens MAX_TOKENS", 80_000), ("--concepts CONCEPTS", DENSE_CONCEPTS),
                          ("--width WIDTH", SHORT_FIT_WIDTH), ("--k K", SHORT_FIT_K), ("--seed SEED", 0)):
        assert re.search(rf"{flag} (?:(?! --).)*\(default: {default}\)", text), flag
    assert "(default: [240, 1000])" in text and "--overwrite clear" in text and "(default: False)" not in text
