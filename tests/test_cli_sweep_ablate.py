"""`conceptlens sweep` and `conceptlens ablate` on a saved tiny Llama with a word-level tokenizer."""

from __future__ import annotations

import re

import pytest
import torch

from conceptlens import ConceptSet
from conceptlens.cli import main
from tests.conftest import tiny_model
from tests.steering.test_sweep import word_tokenizer


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A saved tiny model, a 6-concept set with a mean at blocks.0.resid_out, and a text file."""
    root = tmp_path_factory.mktemp("sweep")
    model, tok = tiny_model("llama"), word_tokenizer()
    model.generation_config.eos_token_id = 1
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    g = torch.Generator().manual_seed(0)
    ConceptSet(torch.randn(6, 32, generator=g), site="blocks.0.resid_out", method="kmeans",
               mean=torch.randn(32, generator=g), model=str(root / "model")).save(root / "concepts")
    lines = [" ".join(f"w{int(i)}" for i in torch.randint(3, 99, (12,), generator=g)) for _ in range(24)]
    (root / "texts.txt").write_text("\n".join(lines) + "\n")
    return str(root / "model"), str(root / "concepts"), str(root / "texts.txt")


def test_sweep_prints_target_and_perplexity_per_alpha(folders, capsys):
    model_dir, concepts_dir, _ = folders
    code = main(["sweep", "--model", model_dir, "--concepts", concepts_dir, "--concept", "1", "--alphas", "0", "0.5",
                 "4", "--prompts", "w5 w6", "w7 w8 w9", "--max-new-tokens", "3"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "concept 1 (centred) at blocks.0.resid_out; alpha in x the site's robust token norm" in out
    header = next(line for line in out.splitlines() if line.strip().startswith("alpha"))
    assert "concept projection (robust norms)" in header and "perplexity" in header
    rows = [line for line in out.splitlines() if re.match(r"\s+\d+\.\d\d\s", line)]
    assert [float(r.split()[0]) for r in rows] == [0.0, 0.5, 4.0]
    projection = [float(r.split()[1]) for r in rows]
    assert projection[2] > projection[0]  # steering along the concept puts the text further along it
    assert re.search(r"largest alpha within the fluency budget \(median perplexity at most 2x the unsteered "
                     r"\d+\.\d\d\): (0|0\.5|4)\n", out)
    assert main(["sweep", "--model", model_dir, "--concepts", concepts_dir, "--concept", "1", "--budget", "0.5"]) == 2
    assert "0.5 is below 1" in capsys.readouterr().err


def test_sweep_plot_names_a_bad_suffix_at_once_and_saves_into_a_new_folder_after_the_table(folders, tmp_path, capsys):
    model_dir, concepts_dir, _ = folders
    sweep = ["sweep", "--model", model_dir, "--concepts", concepts_dir, "--concept", "1", "--alphas", "0", "2",
             "--prompts", "w5 w6", "--max-new-tokens", "2"]
    assert main([*sweep, "--plot", str(tmp_path / "dose.jpeg")]) == 2
    err = capsys.readouterr().err
    assert "dose.jpeg' has no figure suffix; end it in .png, .pdf, .svg" in err and err.count("\n") == 1
    figure = tmp_path / "figures" / "new" / "dose.svg"  # a folder that does not exist yet
    assert main([*sweep, "--plot", str(figure)]) == 0
    out = capsys.readouterr().out
    assert out.index("largest alpha within") < out.index(f"figure saved to {figure}")
    assert figure.read_text().lstrip().startswith("<?xml") and "<svg" in figure.read_text()


def test_ablate_prints_baseline_controls_spread_and_the_zeroed_site(folders, capsys):
    model_dir, concepts_dir, texts = folders
    code = main(["ablate", "--concepts", concepts_dir, "--concept", "1", "3", "--data", texts, "--n-controls", "3",
                 "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "ablating concepts 1, 3 (centred) at blocks.0.resid_out by projection, positions after-first" in out
    assert re.search(r"next_token_loss \(nats\): clean \d+\.\d{4} \(unigram entropy \d+\.\d{4}\)", out)
    assert re.search(r"controls: 3 x random directions with the activation covariance: \d+\.\d{4} \+- \d+\.\d{4}", out)
    assert "site zeroed at the same positions" in out and "warning: only 3 controls" in out
    code = main(["ablate", "--concepts", concepts_dir, "--concept", "1", "--data", texts, "--controls", "concepts",
                 "--mode", "mean", "--n-controls", "2", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0 and "controls: 2 x random concepts of the same set" in out and "by mean" in out


def test_ablate_argument_errors(folders, capsys):
    model_dir, concepts_dir, texts = folders
    assert main(["ablate", "--concepts", concepts_dir, "--concept", "9", "--data", texts]) == 2
    assert "--concept 9 is out of range" in capsys.readouterr().err
    assert main(["ablate", "--concepts", concepts_dir, "--concept", "1", "--data", texts, "--task", "probe"]) == 2
    assert "needs a bundled set with one label per document" in capsys.readouterr().err


def test_ablate_reads_the_split_a_bundled_set_names(folders, capsys, monkeypatch):
    from conceptlens import data

    _, concepts_dir, _ = folders
    loaded = []
    load = data.load
    monkeypatch.setattr(data, "load", lambda name, split="train": loaded.append((name, split)) or load(name, split))
    assert main(["ablate", "--concepts", concepts_dir, "--concept", "1", "--data", "bbc-news:train", "--max-docs", "2",
                 "--max-length", "8", "--n-controls", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out  # train documents are not held out
    assert loaded == [("bbc-news", "train")] and "; 2 documents of bbc-news:train" in out


def test_ablate_names_a_width_that_is_not_the_sites_and_too_few_controls_before_the_model_loads(folders, tmp_path,
                                                                                                capsys, monkeypatch):
    from conceptlens import models

    model_dir, concepts_dir, texts = folders
    ConceptSet(torch.randn(6, 48), site="blocks.0.resid_out", model=model_dir).save(tmp_path / "wide")
    assert main(["ablate", "--concepts", str(tmp_path / "wide"), "--concept", "1", "--data", texts,
                 "--no-progress"]) == 2
    err = capsys.readouterr().err  # the site's width is 32, the set's 48 (a message about a mean's width before)
    assert "the concepts have width 48, but blocks.0.resid_out has width 32" in err and err.count("\n") == 1
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["ablate", "--concepts", concepts_dir, "--concept", "1", "--data", texts, "--n-controls", "1"]) == 2
    assert "--n-controls must be at least 2 (their spread is part of the result); got 1" in capsys.readouterr().err


def test_sets_of_several_sites_are_refused_in_one_line_by_ablate_and_eval(folders, tmp_path, capsys, monkeypatch):
    """A crosscoder's set lives at "A+B", a CLVQ code space at "A->B:z_e": no model site. ablate and eval
    take sets of one site and say so, before the model loads (they named the string as a bad site)."""
    from conceptlens import models

    model_dir, _, texts = folders
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    for method, site in (("crosscoder", "blocks.0.resid_out+blocks.1.resid_out"),
                         ("clvq", "blocks.0.mlp.in->blocks.0.mlp_out:z_e")):
        folder = tmp_path / method
        ConceptSet(torch.randn(6, 32), site=site, method=method, model=model_dir).save(folder)
        for argv in (["ablate", "--concepts", str(folder), "--concept", "1", "--data", texts],
                     ["eval", str(folder), "--suite", "reconstruction"]):
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert f"the {method} set in {folder} lives at {site!r}, not at one site of the model: {argv[0]} takes " \
                   "a set of one site" in err and err.count("\n") == 1, err


def test_ablate_finds_the_model_the_sets_run_toml_names_and_refuses_what_does_not_apply(folders, tmp_path, capsys):
    model_dir, _, texts = folders
    run = tmp_path / "run"
    ConceptSet(torch.randn(6, 32), site="blocks.0.resid_out", model="a-name-that-is-no-model").save(
        run / "concepts" / "km")
    (run / "run.toml").write_text(f'model = "{model_dir}"\n')  # the run's model, by its whole path
    argv = ["ablate", "--concepts", str(run / "concepts" / "km"), "--concept", "1", "--data", texts,
            "--n-controls", "2", "--max-docs", "2", "--no-progress"]
    code, out = main(argv), capsys.readouterr().out
    assert code == 0 and "ablating concept 1 at blocks.0.resid_out" in out
    assert main([*argv, "--probe-site", "blocks.1.resid_out"]) == 2  # ignored before
    err = capsys.readouterr().err
    assert "--probe-site 'blocks.1.resid_out' is where --task probe's probe reads" in err and err.count("\n") == 1


def test_next_token_ablation_of_an_encoder_is_refused_in_one_line(tmp_path, capsys):
    ConceptSet(torch.randn(4, 384), site="blocks.3.resid_out", model="minilm-l6").save(tmp_path / "cs")
    assert main(["ablate", "--concepts", str(tmp_path / "cs"), "--concept", "1", "--max-docs", "2",
                 "--no-progress"]) == 2  # a traceback ("no attribute logits") before
    err = capsys.readouterr().err
    assert "--task next_token needs a model that predicts tokens, and BertModel has no language-model head" in err
    assert "use --task probe" in err and err.count("\n") == 1


def test_a_sweep_of_both_signs_names_the_largest_fluent_alpha_on_each_side(folders, capsys):
    model_dir, concepts_dir, _ = folders  # it named the larger magnitude alone: a negative alpha looked "largest"
    assert main(["sweep", "--model", model_dir, "--concepts", concepts_dir, "--concept", "1", "--alphas", "-0.25", "0",
                 "0.25", "--prompts", "w5 w6", "--max-new-tokens", "2", "--budget", "1000"]) == 0
    assert re.search(r"largest alphas within the fluency budget \(median perplexity at most 1000x the unsteered "
                     r"\d+\.\d\d\): 0\.25 towards the direction, -0\.25 away from the direction\n",
                     capsys.readouterr().out)
    assert main(["sweep", "--model", model_dir, "--concepts", concepts_dir, "--concept", "1", "--alphas", "-0.25", "0",
                 "--prompts", "w5 w6", "--max-new-tokens", "2", "--budget", "1000"]) == 0
    assert re.search(r"\): -0\.25 away from the direction\n", capsys.readouterr().out)  # not "none towards"
    assert main(["sweep", "--model", model_dir, "--concepts", concepts_dir, "--concept", "1", "--alphas", "-1000", "0",
                 "1000", "--prompts", "w5 w6", "--max-new-tokens", "2", "--budget", "1"]) == 0
    out = capsys.readouterr().out  # only 0 within the budget: no alpha towards or away is ("0 towards" before)
    assert re.search(r"\): none towards the direction, none away from the direction\n", out), out
