"""`conceptlens fit` with extractors of several sites: a transcoder (SOURCE->TARGET), a crosscoder
(A+B) and a cross-layer transcoder (IN1+IN2->OUT1+OUT2), named in an extractor's `site`."""

from __future__ import annotations

import tomllib

import pytest
import torch
from safetensors.torch import load_file

import conceptlens
from conceptlens import models
from conceptlens.cli import main
from conceptlens.commands import run_config as rc
from conceptlens.commands.eval import _sets as eval_sets
from conceptlens.concepts.clvq import CLVQTranscoder
from conceptlens.concepts.sae import Crosscoder, CrossLayerTranscoder, Transcoder
from conceptlens.concepts.sae.config import short_budget_lr
from tests.test_cli_fit import files  # noqa: F401 - the module's saved tiny Llama and documents

PAIR = "blocks.0.mlp.in->blocks.0.mlp_out"
SITES = "blocks.0.resid_out+blocks.1.resid_out"
GROUPS = "blocks.0.mlp.in+blocks.1.mlp.in->blocks.0.mlp_out+blocks.1.mlp_out"
SMALL = "batch_size=32,warmup_tokens=32,buffer_size=64,seed=3"


def argv(files, out, *extractors, sites=("--site", "blocks.1.resid_out")):  # noqa: F811
    specs = [a for spec in extractors for a in ("--extractor", spec)]
    return ["fit", "--model", str(files / "model"), "--data", str(files / "docs.txt"), "--out", str(out), *sites,
            *specs, "--batch-size", "8", "--max-length", "16", "--max-tokens", "400", "--no-describe"]


def test_cli_fits_multi_site_keys_as_the_library_does(files, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    args = argv(files, out, f"transcoder:site={PAIR},width=8,{SMALL}", f"crosscoder:site={SITES},width=8,k=2,{SMALL}",
                f"cross_layer_transcoder:site={GROUPS},width=8,k=2,name=clt,{SMALL}", f"clvq:site={PAIR},n_codes=4,seed=3",
                sites=())
    assert main(args) == 0, capsys.readouterr().err
    assert ("fitting transcoder, clvq at blocks.0.mlp.in->blocks.0.mlp_out; crosscoder at blocks.0.resid_out+"
            "blocks.1.resid_out; clt at blocks.0.mlp.in+blocks.1.mlp.in->blocks.0.mlp_out+blocks.1.mlp_out -> ") in \
        capsys.readouterr().out  # "fitting transcoder, crosscoder, clt, clvq at  -> " before: the --site list
    small = dict(batch_size=32, warmup_tokens=32, buffer_size=64, seed=3,
                 lr=short_budget_lr(8, 400 // 32, 32))  # the lr the CLI gives an SAE for this budget
    plan = {("blocks.0.mlp.in", "blocks.0.mlp_out"): {"transcoder": Transcoder(width=8, **small)},
            ("blocks.0.resid_out", "blocks.1.resid_out"): {"crosscoder": Crosscoder(width=8, k=2, **small)},
            (("blocks.0.mlp.in", "blocks.1.mlp.in"), ("blocks.0.mlp_out", "blocks.1.mlp_out")):
                {"clt": CrossLayerTranscoder(width=8, k=2, **small)}}
    plan[("blocks.0.mlp.in", "blocks.0.mlp_out")]["clvq"] = CLVQTranscoder(n_codes=4, seed=3)
    model, tok = models.load(str(files / "model"))
    texts = (files / "docs.txt").read_text().splitlines()
    report = conceptlens.attach(model, tok).fit(plan, texts, batch_size=8, max_length=16, max_tokens=400,
                                                progress=False)
    for name in ("transcoder", "crosscoder", "clt", "clvq"):
        saved = load_file(out / "concepts" / name / "concepts.safetensors")
        assert torch.equal(saved["directions"], report.concepts[name].directions), name
    from conceptlens.commands.fit import planned_concepts

    assert all(planned_concepts(ex) == len(report.concepts[name]) for group in plan.values()
               for name, ex in group.items())  # what `fit --steer` checks its indices against
    cfg = rc.from_dict(tomllib.loads((out / "run.toml").read_text()))
    assert cfg.sites == [] and [e["site"] for e in cfg.extractors] == [PAIR, SITES, GROUPS, PAIR]
    assert main(args) == 0  # a rerun reads the same keys from run.toml and resumes the finished fit
    for name in ("transcoder", "crosscoder", "clt", "clvq"):
        again = load_file(out / "concepts" / name / "concepts.safetensors")
        assert torch.equal(again["directions"], report.concepts[name].directions), name


def test_describe_report_and_eval_leave_out_sets_that_read_other_sites(files, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    args = [a for a in argv(files, out, "kmeans:n_concepts=4,init_size=64", f"crosscoder:site={SITES},width=8,k=2,"
                            f"{SMALL}") if a != "--no-describe"]
    assert main(args + ["--describe-tokens", "200"]) == 0
    assert "not describing crosscoder" in capsys.readouterr().out
    assert (out / "describe" / "kmeans" / "description.json").is_file()
    assert not (out / "describe" / "crosscoder").exists()
    assert main(["report", str(out), "--no-progress"]) == 0  # the atlas of the described sets
    assert list(eval_sets(str(out), None)[0]) == ["kmeans"]  # and the evaluation suites, of the one-site sets
    with pytest.raises(ValueError, match="crosscoder reads other sites than its directions'"):
        eval_sets(str(out), "kmeans,crosscoder")


@pytest.mark.parametrize("spec, message", [
    ("crosscoder:site=blocks.0.resid_out,width=8,k=2",
     "extractor 'crosscoder' (crosscoder) site must be two or more sites joined by '+'"),
    ("crosscoder:width=8,k=2", "site must be two or more sites joined by '+', e.g. blocks.3.resid_out+"
                               "blocks.6.resid_out; got None"),
    (f"transcoder:site={SITES},width=8", "(transcoder) site must be a source and a target site joined by '->'"),
    ("transcoder:site=blocks.0.mlp.in->,width=8", "got 'blocks.0.mlp.in->'"),
    ("cross_layer_transcoder:site=blocks.0.mlp.in+blocks.1.mlp.in->blocks.0.mlp_out,width=8,k=2",
     "site must be input sites joined by '+', '->', as many output sites"),
    (f"kmeans:site={PAIR},n_concepts=4", f"kmeans reads one site; '{PAIR}' names several"),
    ("crosscoder:site=blocks.0.resid_out/blocks.1.resid_out,width=8,k=2", "got ('blocks.0.resid_out', "),
])
def test_bad_multi_site_keys_fail_in_one_line_before_the_model_loads(files, tmp_path, monkeypatch, capsys,  # noqa: F811
                                                                     spec, message):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load", no_load)
    assert main(argv(files, tmp_path / "bad", spec)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("conceptlens fit: error:") and message in err and "\n" not in err
    assert not (tmp_path / "bad").exists()


def test_an_unknown_site_in_a_key_fails_in_one_line_before_anything_is_written(files, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "bad"
    assert main(argv(files, out, "crosscoder:site=blocks.0.resid_out+blocks.9.resid_out,width=8,k=2")) == 2
    err = capsys.readouterr().err.strip()
    assert "blocks.9.resid_out" in err and "\n" not in err
    assert not (out / "run.toml").exists()
