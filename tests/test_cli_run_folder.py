"""A run folder holds one run: `fit` refuses another run's folder unless --overwrite (which
clears only that run's files); `describe` finishes without a stale checkpoint and takes
--no-resume; an empty data file fails before the model loads; the fit prints FVU / L0 /
steps per extractor and warns about an SAE with too few steps."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

import conceptlens.fit
from conceptlens import models
from conceptlens.cli import main
from conceptlens.commands.fit_summary import MIN_SAE_STEPS
from conceptlens.runlock import LOCK_FILE
from tests.test_cli_fit import base, files, interrupt_at_step  # noqa: F401 - the fixture: a tiny Llama folder and docs.txt


def _other_run(files, out, *extra):  # noqa: F811 - another run: one extractor of another name and kind
    argv = base(files, out, *extra)
    keep = [a for i, a in enumerate(argv) if a != "--extractor" and argv[i - 1] != "--extractor"]
    return keep + ["--extractor", "kmeans:n_concepts=3,init_size=32,name=k3"]


def test_another_runs_folder_is_refused_and_overwrite_clears_only_its_files(files, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    assert main(base(files, out)) == 0
    (out / "notes.txt").write_text("mine")
    (out / "concepts" / "km" / "mine.txt").write_text("mine too")
    (out / "eval.json").write_text("{}")  # as `conceptlens eval` leaves it: figures of this run's sets
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    capsys.readouterr()
    assert main(_other_run(files, out, "--no-resume")) == 2  # --no-resume alone never mixes two runs
    err = capsys.readouterr().err.strip()
    assert "holds a run with another extractor" in err and "--overwrite" in err and "\n" not in err
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before  # nothing touched
    assert main(_other_run(files, out, "--overwrite")) == 0
    # run.toml, checkpoint.pt, fit_report.json, eval.json; 2 sets of 2 files; describe/source.json; 2 descriptions
    # of 4 files
    assert f"--overwrite: removed the 17 files of the run {out} held" in capsys.readouterr().out
    assert not (out / "eval.json").exists()
    assert sorted(p.name for p in (out / "concepts").iterdir()) == ["k3", "km"]
    assert sorted(p.name for p in (out / "concepts" / "km").iterdir()) == ["mine.txt"]  # only the user's file
    assert sorted(p.name for p in (out / "describe").iterdir() if p.is_dir()) == ["k3"]
    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "fit_report.json").read_text())["concepts"] == ["k3"]
    assert not list(out.glob(".overwritten*"))


def test_overwrite_clears_nothing_behind_a_link_nor_before_the_sites_are_checked(files, tmp_path, capsys):  # noqa: F811
    out, shared = tmp_path / "run", tmp_path / "shared"
    assert main(base(files, out, "--no-describe")) == 0
    shared.mkdir()
    (shared / "keep.json").write_text("{}")  # matches hierarchy/*.json through the link
    (out / "hierarchy").symlink_to(shared, target_is_directory=True)
    (shared / "concepts.safetensors").write_text("not the run's")
    (out / "concepts" / "linked").symlink_to(shared, target_is_directory=True)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    bad = _other_run(files, out, "--overwrite")
    bad[bad.index("--site") + 1] = "blocks.99.resid_out"
    capsys.readouterr()
    assert main(bad) == 2  # a typo: refused once the model has loaded, before anything is cleared
    assert "blocks.99.resid_out" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert main(_other_run(files, out, "--overwrite", "--no-describe")) == 0
    assert sorted(p.name for p in shared.iterdir()) == ["concepts.safetensors", "keep.json"]
    assert (out / "hierarchy").is_symlink() and (out / "concepts" / "linked").is_symlink()
    assert json.loads((out / "fit_report.json").read_text())["concepts"] == ["k3"]


def test_overwrite_refuses_a_folder_whose_run_toml_is_not_a_runs_and_clears_nothing_without_one(
        files, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "mine"
    out.mkdir()
    (out / "run.toml").write_text('title = "my notes"\n')
    (out / "eval.json").write_text('{"mine": 1}')
    assert main(base(files, out, "--overwrite", "--no-describe")) == 2
    err = capsys.readouterr().err.strip()
    assert str(out / "run.toml") in err and "not a conceptlens run" in err and "\n" not in err
    assert (out / "run.toml").read_text() == 'title = "my notes"\n' and (out / "eval.json").exists()
    (out / "run.toml").unlink()  # no run.toml: no run to clear, and a file of a run's name is the user's
    for flag in ("--overwrite", "--no-resume"):
        assert main(base(files, out, flag, "--no-describe")) == 2
        err = capsys.readouterr().err.strip()
        assert "holds eval.json but no run.toml" in err and "--out" in err and "\n" not in err
        assert sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE) == ["eval.json"]
        assert (out / "eval.json").read_text() == '{"mine": 1}'
    (out / "notes.txt").write_text("mine")
    (out / "eval.json").rename(out / "my-eval.json")  # files of other names: the fit writes its own beside them
    assert main(base(files, out, "--overwrite", "--no-describe")) == 0
    assert (out / "my-eval.json").read_text() == '{"mine": 1}' and (out / "run.toml").is_file()
    assert main(base(files, out, "--overwrite", "--no-describe")) == 0  # and clears only its own
    assert (out / "notes.txt").read_text() == "mine" and (out / "my-eval.json").is_file()


def test_a_folder_without_run_toml_holding_a_runs_file_names_is_refused_and_loses_nothing(
        files, tmp_path, capsys):  # noqa: F811
    """A user's checkpoint.pt (or quality.json, or hierarchy/*.json) in a folder that holds no run is not
    the run's: the fit neither writes over it (it did under --no-resume) nor lets a later --overwrite
    delete it."""
    for name in ("checkpoint.pt", "quality.json", "steering.json", "hierarchy/tree.json", "concepts/mine/config.json"):
        out = tmp_path / name.replace("/", "_")
        (out / name).parent.mkdir(parents=True)
        (out / name).write_text("mine")
        for extra in ((), ("--no-resume",), ("--overwrite",)):
            capsys.readouterr()
            assert main(base(files, out, *extra, "--no-describe")) == 2
            err = capsys.readouterr().err.strip()
            assert f"holds {name} but no run.toml" in err and "\n" not in err
            left = [p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.name != LOCK_FILE]
            assert left == [name]
            assert (out / name).read_text() == "mine"


def test_a_finished_describe_leaves_no_checkpoint_and_no_resume_restarts_an_interrupted_one(
        files, tmp_path, monkeypatch, capsys):  # noqa: F811
    out = tmp_path / "run"
    assert main(base(files, out)) == 0  # fit, then the description of both sets
    assert not (out / "describe" / "checkpoint.pt").exists()
    assert main(["describe", str(out), "--concepts", "km", "--describe-tokens", "200"]) == 0
    step = interrupt_at_step(monkeypatch, 4)
    assert main(["describe", str(out), "--concepts", "topk"]) == 130  # after a checkpoint at 150 tokens
    monkeypatch.setattr(conceptlens.fit, "_step", step)
    assert (out / "describe" / "checkpoint.pt").is_file()  # of a pass over topk
    capsys.readouterr()
    assert main(["describe", str(out), "--concepts", "km"]) == 2  # that checkpoint is not km's
    assert "resume=False (--no-resume on the command line)" in capsys.readouterr().err
    assert main(["describe", str(out), "--concepts", "km", "--no-resume"]) == 0
    assert not (out / "describe" / "checkpoint.pt").exists()


@pytest.mark.parametrize("content", ["", "\n\n", "  \n\t\n"])
def test_an_empty_or_blank_data_file_fails_before_the_model_loads(files, tmp_path, monkeypatch, capsys,  # noqa: F811
                                                                 content):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load", no_load)
    data = tmp_path / "empty.txt"
    data.write_text(content)
    argv = base(files, tmp_path / "run")
    argv[argv.index("--data") + 1] = str(data)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("conceptlens fit: error:") and str(data) in err and "empty or blank" in err
    assert "\n" not in err
    assert not (tmp_path / "run").exists()
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": "  "}\n\n{"text": ""}\n')
    argv[argv.index("--data") + 1] = str(blank)
    assert main(argv) == 2 and str(blank) in capsys.readouterr().err


def test_describe_refuses_an_empty_data_file_before_the_model_loads(files, tmp_path, monkeypatch, capsys):  # noqa: F811
    out = tmp_path / "run"
    assert main(base(files, out, "--no-describe", "--max-tokens", "100")) == 0
    (tmp_path / "empty.jsonl").write_text("\n")

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load", no_load)
    capsys.readouterr()
    assert main(["describe", str(out), "--describe-data", str(tmp_path / "empty.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert str(tmp_path / "empty.jsonl") in err and "empty or blank" in err and "\n" not in err


def test_the_fit_prints_fvu_l0_and_steps_and_warns_about_an_sae_with_few_steps(files, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    assert main(base(files, out, "--no-describe")) == 0
    printed = capsys.readouterr()
    stats = json.loads((out / "fit_report.json").read_text())["stats"]
    topk, km = stats["topk"], stats["km"]
    assert 0 < topk["steps"] < MIN_SAE_STEPS
    assert f"  topk: FVU {topk['mean']['fvu']:.3f}, L0 {topk['mean']['l0']:.1f}, {topk['steps']} optimiser steps" \
        in printed.out
    assert f"  km: {km['steps']} optimiser steps" in printed.out
    warning = [line for line in printed.err.splitlines() if line.startswith("warning: topk")]
    assert len(warning) == 1 and f"only {topk['steps']} optimiser steps" in warning[0]
    assert "--max-tokens" in warning[0] and "batch_size=" in warning[0]
    many = [a.replace("topk:width=16,k=2,batch_size=64,warmup_tokens=64", "topk:width=16,k=2,batch_size=2,"
                      "warmup_tokens=2,buffer_size=2") for a in base(files, tmp_path / "many", "--no-describe")]
    assert main(many) == 0
    steps = json.loads((tmp_path / "many" / "fit_report.json").read_text())["stats"]["topk"]["steps"]
    assert steps >= MIN_SAE_STEPS and "warning: topk" not in capsys.readouterr().err
    assert load_file(tmp_path / "many" / "concepts" / "topk" / "concepts.safetensors")


@pytest.mark.parametrize("bad, message", [
    (("--max-length", "100"), "--max-length=100 is beyond the position limit of GPT2LMHeadModel: 64 tokens"),
    (("--site", "blocks.1.attn.pattern"), "site 'blocks.1.attn.pattern' has shape (B, T, 4, T), whose width grows"),
])
def test_overwrite_clears_nothing_before_the_max_length_and_the_sites_width_are_checked(
        files, tmp_path, capsys, bad, message):  # noqa: F811
    """Options the model decides (its position limit, a site whose width grows with the sequence)
    are refused before --overwrite clears the old run, and before run.toml records them."""
    from tests.conftest import tiny_model
    from tests.steering.test_sweep import word_tokenizer

    gpt2 = tmp_path / "gpt2"
    tiny_model("gpt2").save_pretrained(gpt2)
    word_tokenizer().save_pretrained(gpt2)
    out = tmp_path / "run"
    good = base(files, out, "--no-describe")
    good[good.index("--model") + 1] = str(gpt2)
    assert main(good) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    fresh = tmp_path / "fresh"
    for argv in (good + ["--overwrite"], [fresh if a == str(out) else a for a in good]):
        argv = [str(a) for a in argv]
        argv[argv.index(bad[0]) + 1] = bad[1]
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert not (fresh / "run.toml").exists()  # so the corrected command is not refused as another run


def test_a_set_the_last_fit_did_not_write_is_neither_described_nor_shown(files, tmp_path, capsys):  # noqa: F811
    """A refit in which one extractor fits nothing leaves that set's folder from the earlier fit; `describe
    RUN` and the atlas follow fit_report.json's list instead of describing it as this run's."""
    out = tmp_path / "run"
    argv = base(files, out)
    argv[argv.index("topk:width=16,k=2,batch_size=64,warmup_tokens=64")] = "vq:n_codes=150,init_size=150"
    assert main(argv) == 0
    assert sorted(p.name for p in (out / "describe").iterdir() if p.is_dir()) == ["km", "vq"]
    refit = list(argv) + ["--no-resume"]
    refit[refit.index("--max-tokens") + 1] = "60"  # too few rows for vq to start: the fit writes km only
    capsys.readouterr()
    assert main(refit) == 0
    assert "warning: no concepts from vq" in capsys.readouterr().err
    assert json.loads((out / "fit_report.json").read_text())["concepts"] == ["km"]
    assert (out / "concepts" / "vq" / "concepts.safetensors").is_file()  # the earlier fit's, left in place
    capsys.readouterr()
    assert main(["describe", str(out), "--describe-tokens", "200"]) == 0
    assert "vq" not in capsys.readouterr().out
    assert main(["describe", str(out), "--concepts", "vq"]) == 2
    assert "an earlier fit's: the last fit, fit_report.json, wrote no such set" in capsys.readouterr().err
    assert main(["report", str(out), "--no-progress"]) == 0
    assert "warning: left out of the atlas: vq, from an earlier fit" in capsys.readouterr().err
    assert not (out / "report" / "vq").exists()


def test_a_control_set_of_random_directions_is_described_and_shown_though_the_fit_wrote_it_not(files, tmp_path,  # noqa: F811
                                                                                               capsys):
    """The demo saves concepts/random (a control the description pass makes, not in fit_report.json):
    `describe RUN` describes it again with the rest, and the atlas shows it as control rows, unwarned."""
    import torch

    from conceptlens.concepts.conceptset import ConceptSet
    from conceptlens.report.atlas import Atlas

    out = tmp_path / "run"
    assert main(base(files, out)) == 0
    km = ConceptSet.load(out / "concepts" / "km")
    ConceptSet(torch.randn(16, km.d, generator=torch.Generator().manual_seed(0)), km.site, method="random",
               model=km.model, mean=km.mean).save(out / "concepts" / "random")
    capsys.readouterr()
    assert main(["describe", str(out), "--describe-tokens", "200"]) == 0
    assert json.loads((out / "describe" / "random" / "description.json").read_text())["control"] is True
    assert main(["report", str(out), "--no-progress"]) == 0
    assert "left out of the atlas" not in capsys.readouterr().err
    atlas = Atlas.load(out)
    assert [v.name for v in atlas.controls] == ["random"] and "random" not in [v.name for v in atlas.extractors]
    assert not (out / "report" / "random").exists()  # control rows, no pages


def test_relative_model_and_data_paths_are_recorded_absolute(files, tmp_path, monkeypatch, capsys):  # noqa: F811
    """`describe RUN` run from another folder reads the fit's own documents, not that folder's docs.txt."""
    import shutil

    from conceptlens.commands import run_config as rc

    here = tmp_path / "project"
    shutil.copytree(files, here)
    monkeypatch.chdir(here)
    out = tmp_path / "run"
    argv = base(files, out, "--no-describe")
    argv[argv.index("--model") + 1], argv[argv.index("--data") + 1] = "model", "./docs.txt"
    assert main(argv) == 0
    recorded = rc.read_toml(out / "run.toml")
    assert recorded["model"] == str(here / "model") and recorded["data"] == str(here / "docs.txt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "docs.txt").write_text("w5 w6 w7\n" * 500)  # another file under the same name
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["describe", str(out), "--describe-tokens", "200"]) == 0
    assert f"tokens of {here / 'docs.txt'} (documents from" in capsys.readouterr().out
    argv[argv.index("--model") + 1] = str(here / "model")
    assert main(argv) == 2  # ./docs.txt here is another file: another run
    assert "holds a run with another data" in capsys.readouterr().err


def test_a_folder_named_like_a_bundled_set_does_not_shadow_it(tmp_path, monkeypatch):
    """`fit --out bbc-news` makes a folder of that name: later `--data bbc-news` still means the set."""
    from conceptlens.commands._args import data_source
    from conceptlens.commands.fit import _record_local_paths_absolute
    from conceptlens.commands.sources import source

    monkeypatch.chdir(tmp_path)
    (tmp_path / "bbc-news").mkdir()
    assert data_source("bbc-news") == "bbc-news" and data_source("bbc-news:test") == "bbc-news:test"
    assert source("bbc-news", None).name == "bbc-news"
    raw = {"model": "smollm2-135m", "data": "bbc-news", "describe": {"data": "bbc-news"}}
    _record_local_paths_absolute(raw)
    assert raw == {"model": "smollm2-135m", "data": "bbc-news", "describe": {"data": "bbc-news"}}


def test_overwrite_clears_the_runs_report_but_no_file_the_report_did_not_write(files, tmp_path, capsys):  # noqa: F811
    first = tmp_path / "first"
    assert main(base(files, first)) == 0
    assert main(["report", str(first), "--no-progress"]) == 0
    out = tmp_path / "run"
    first.rename(out)  # a moved run: its report names the folder it was made in
    assert (out / "report" / "concepts" / "km" / "0.html").is_file()
    (out / "report" / "mine.txt").write_text("mine")
    capsys.readouterr()
    assert main(_other_run(files, out, "--overwrite")) == 0  # the old report showed the old concepts
    assert "--overwrite: removed the" in capsys.readouterr().out
    assert sorted(p.relative_to(out).as_posix() for p in (out / "report").rglob("*")) == ["report/mine.txt"]


def test_overwrite_clears_no_file_outside_the_report_whatever_its_manifest_lists(files, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    assert main(base(files, out)) == 0
    assert main(["report", str(out), "--no-progress"]) == 0
    manifest = out / "report" / "conceptlens-report.json"
    data = json.loads(manifest.read_text())
    data["files"] += ["../notes.txt", "../../outside.txt", str(tmp_path / "abs.txt")]  # a hostile list
    manifest.write_text(json.dumps(data))
    for kept in (out / "notes.txt", tmp_path / "outside.txt", tmp_path / "abs.txt"):
        kept.write_text("mine")
    assert main(_other_run(files, out, "--overwrite")) == 0
    assert all(p.read_text() == "mine" for p in (out / "notes.txt", tmp_path / "outside.txt", tmp_path / "abs.txt"))
    assert not (out / "report").exists()
