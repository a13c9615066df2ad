"""Every subcommand given wrong types, missing or hostile files, empty and huge values, on a tiny
model folder: exit code 2 and one line on stderr, never a traceback (even where the mistake
is only found after the model loaded)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conceptlens import ConceptSet
from conceptlens.cli import main
from tests.tiny_folder import save_tiny_llama

SITE = "blocks.0.resid_out"
HUGE = str(10**12)
INT128 = str(2**70)
PROGRESS = re.compile(r"[\dk?](it|tok|doc)/s\]")  # a progress bar's line, not a message


class Hostile:
    """Unpickling this would create the file `marker`: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _nested_toml(depth: int) -> str:
    return "x = " + "[" * depth + "]" * depth + "\n"


@pytest.fixture(scope="module")
def t(tmp_path_factory):
    """Tiny model folders, data, concept sets and a fitted run folder."""
    root = tmp_path_factory.mktemp("hostile")
    save_tiny_llama(root / "model")
    (root / "pickled").mkdir()
    (root / "pickled" / "config.json").write_text((root / "model" / "config.json").read_text())
    for tokenizer_file in (root / "model").glob("*token*"):
        (root / "pickled" / tokenizer_file.name).write_bytes(tokenizer_file.read_bytes())
    torch.save({"model.embed_tokens.weight": Hostile(root / "ran")}, root / "pickled" / "pytorch_model.bin")
    (root / "docs.txt").write_text("\n".join(f"some words number {i} and more text here" for i in range(40)) + "\n")
    g = torch.Generator().manual_seed(0)
    ConceptSet(torch.randn(3, 32, generator=g), SITE, method="kmeans", model="model").save(root / "set")
    ConceptSet(torch.randn(3, 32, generator=g), SITE, method="kmeans", model="other-model").save(root / "other")
    nan = torch.randn(3, 32, generator=g)
    nan[1, 4] = float("nan")
    ConceptSet(nan, SITE, method="kmeans", model="model").save(root / "nanset")
    (root / "deep.toml").write_text(_nested_toml(5000))
    (root / "typed.toml").write_text('model = 5\ndata = "x"\n')
    (root / "bigseed.toml").write_text(f'model = "{root / "model"}"\ndata = "{root / "docs.txt"}"\n'
                                       f'sites = ["{SITE}"]\n[[extractor]]\nsite = "{SITE}"\nmethod = "kmeans"\nn_concepts = 4\n'
                                       f"seed = {INT128}\n")
    assert main(["fit", "--model", str(root / "model"), "--data", str(root / "docs.txt"), "--out", str(root / "run"),
                 "--site", SITE, "--extractor", "kmeans:n_concepts=3,init_size=32,name=km", "--batch-size", "8",
                 "--max-length", "16", "--max-tokens", "300", "--describe-tokens", "200", "--top-n", "2",
                 "--threads", "1"]) == 0
    return root


def _hostile_description(run, name: str, change) -> None:
    folder = run / "describe" / "km"
    info = json.loads((folder / "description.json").read_text())
    change(info, folder)
    (folder / "description.json").write_text(json.dumps(info))


def _huge_and_empty(info, folder):
    info["n_concepts"] = 200_000
    save_file({}, folder / "stats.safetensors", metadata={"format": "conceptlens.Description"})
    (folder / "contexts.jsonl").unlink()


def _contexts_typed(info, folder):
    (folder / "contexts.jsonl").write_text('[1, 2]\n{"concept": 1, "contexts": 5}\n')


def _hierarchy_past_n(info, folder):
    (folder.parent.parent / "hierarchy").mkdir(exist_ok=True)
    dag = {"directed": True, "multigraph": False, "graph": {}, "nodes": [{"id": 0}, {"id": 99}],
           "edges": [{"source": 0, "target": 99}]}
    (folder.parent.parent / "hierarchy" / "km.json").write_text(json.dumps(dag))


M = ["--model", "{t}/model"]
STEER = ["steer", *M, "--concepts", "{t}/set", "--concept", "0", "--prompt", "hello", "--threads", "1"]
SWEEP = ["sweep", *M, "--concepts", "{t}/set", "--concept", "0", "--prompts", "hello", "--threads", "1"]
ABLATE = ["ablate", *M, "--concepts", "{t}/set", "--concept", "0", "--data", "{t}/docs.txt", "--no-progress",
          "--threads", "1"]
FIT = ["fit", *M, "--data", "{t}/docs.txt", "--site", SITE, "--no-describe", "--threads", "1"]

CASES = {
    # steer
    "steer-alpha-overflows": (STEER + ["--alpha", "1e300"], "alpha=1e+300", "overflows float32"),
    "steer-alpha-float32-max": (STEER + ["--alpha", "1e39", "--scale", "raw"], "overflows float32"),
    "steer-tokens-past-context": (STEER + ["--max-new-tokens", str(2**62)], "--max-new-tokens", "256"),
    "steer-tokens-int64": (STEER + ["--max-new-tokens", str(2**63)], "--max-new-tokens", "too large"),
    "steer-device-mps": (STEER + ["--device", "mps"], "--device 'mps'", "valid: cpu"),
    "steer-device-meta": (STEER + ["--device", "meta"], "--device 'meta'", "valid: cpu"),
    "steer-device-junk": (STEER + ["--device", "gpu7"], "--device 'gpu7'", "valid: cpu"),
    "steer-threads-huge": (STEER + ["--threads", INT128], "--threads", "too large"),
    "steer-nan-set": (["steer", *M, "--concepts", "{t}/nanset", "--concept", "0", "--prompt", "hi"], "NaN"),
    "steer-concept-str": (STEER + ["--concept", "x"], "--concept", "invalid int"),
    "steer-concept-range": (STEER + ["--concept", "99"], "--concept 99", "0-2"),
    "steer-pickled-model": (["steer", "--model", "{t}/pickled", "--concepts", "{t}/set", "--concept", "0",
                             "--prompt", "hi"], "pickled", "pickle", "safetensors"),
    "steer-missing-model": (["steer", "--model", "{t}/nope", "--concepts", "{t}/set", "--prompt", "hi"], "nope"),
    # sweep
    "sweep-alpha-overflows": (SWEEP + ["--alphas", "0", "1e300"], "alpha=1e+300", "overflows"),
    "sweep-tokens-past-context": (SWEEP + ["--max-new-tokens", "100000"], "--max-new-tokens", "256"),
    "sweep-nan-set": (["sweep", *M, "--concepts", "{t}/nanset", "--concept", "0"], "NaN"),
    # ablate
    "ablate-nan-set": (["ablate", *M, "--concepts", "{t}/nanset", "--concept", "0", "--data", "{t}/docs.txt"], "NaN"),
    "ablate-seed-huge": (ABLATE + ["--seed", INT128], "--seed", "too large"),
    "ablate-seed-negative": (ABLATE + ["--seed", "-1"], "--seed"),
    "ablate-max-docs-str": (ABLATE + ["--max-docs", "many"], "--max-docs", "not an integer"),
    "ablate-device-meta": (ABLATE + ["--device", "meta"], "--device"),
    # gauge
    "gauge-pairs-huge": (["gauge", *M, "--layer", "1", "--pairs", HUGE, "--data", "{t}/docs.txt"], "--pairs", "GiB"),
    "gauge-layer-missing": (["gauge", *M, "--layer", "99", "--data", "{t}/docs.txt"], "99"),
    "gauge-seed-huge": (["gauge", *M, "--seed", INT128], "--seed"),
    # fit
    "fit-width-huge": (FIT + ["--out", "{out}", "--extractor", f"topk:width={HUGE},k=2"], "width must be at most"),
    "fit-concepts-huge": (FIT + ["--out", "{out}", "--extractor", f"kmeans:n_concepts={HUGE}"], "n_concepts"),
    "fit-concepts-negative": (FIT + ["--out", "{out}", "--extractor", "kmeans:n_concepts=-3"], "n_concepts"),
    "fit-seed-huge": (FIT + ["--out", "{out}", "--extractor", f"kmeans:n_concepts=3,seed={INT128}"], "seed"),
    "fit-name-slash": (FIT + ["--out", "{out}", "--extractor", "kmeans:n_concepts=3,name=a/b"], "name", "a/b"),
    "fit-deep-toml": (["fit", "{t}/deep.toml", "--out", "{out}"], "deep.toml", "nested deeper"),
    "fit-typed-toml": (["fit", "{t}/typed.toml", "--out", "{out}"], "model"),
    "fit-toml-seed-huge": (["fit", "{t}/bigseed.toml", "--out", "{out}", "--no-describe"], "seed"),
    "fit-missing-config": (["fit", "{t}/nope.toml"], "nope.toml"),
    "fit-batch-huge": (FIT + ["--out", "{out}", "--extractor", "kmeans:n_concepts=3", "--batch-size", INT128],
                       "batch"),
    "fit-tokens-str": (FIT + ["--out", "{out}", "--extractor", "kmeans:n_concepts=3", "--max-tokens", "lots"],
                       "--max-tokens"),
    # describe, report, eval, sites, demo
    "describe-missing-run": (["describe", "{t}/nope"], "nope"),
    "describe-top-n-huge": (["describe", "{t}/run", "--top-n", INT128], "top"),
    "report-missing-run": (["report", "{t}/nope"], "nope"),
    "eval-nan-set": (["eval", "{t}/nanset", "--task", "bbc-news", *M], "NaN"),
    "eval-seed-huge": (["eval", "{t}/set", "--task", "bbc-news", "--seed", INT128], "--seed"),
    "sites-pickled-model": (["sites", "--model", "{t}/pickled"], "pickled", "pickle"),
    "sites-threads-zero": (["sites", *M, "--threads", "0"], "--threads"),
    "demo-width-huge": (["demo", *M, "--site", SITE, "--width", HUGE, "--out", "{out}"], "width"),
    "demo-seed-huge": (["demo", *M, "--seed", INT128, "--out", "{out}"], "--seed"),
}


def _check(argv, names, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()
             and not line.startswith(f"conceptlens {argv[0]}: warning:") and not PROGRESS.search(line)]
    assert code == 2, (out, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    for name in names:
        assert name in lines[0], err


@pytest.mark.parametrize("case", CASES)
def test_every_subcommand_refuses_in_one_line(t, tmp_path, capsys, case):
    argv, *names = CASES[case]
    _check([a.replace("{t}", str(t)).replace("{out}", str(tmp_path / "out")) for a in argv], names, capsys)
    assert not (t / "ran").exists()


@pytest.mark.parametrize("change, names", [
    (_huge_and_empty, ["stats.safetensors", "n_concepts=200000"]),
    (_contexts_typed, ["contexts.jsonl", "line 1"]),
    (lambda info, folder: info.update(n_concepts="3"), ["description.json", "n_concepts"]),
    (_hierarchy_past_n, ["km.json", "nodes[1].id", "99"]),
], ids=["huge-n-empty-stats", "contexts-typed", "n-concepts-str", "hierarchy-past-n"])
def test_report_refuses_a_hostile_description_in_one_line(t, tmp_path, capsys, change, names):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(t / "run", run)
    _hostile_description(run, "km", change)
    _check(["report", str(run), "--no-progress"], names, capsys)
    assert not (run / "report" / "concepts" / "km" / "199999.html").exists()


def test_a_full_disk_during_fit_names_the_file_and_the_cause(t, tmp_path, capsys, monkeypatch):
    import errno

    import conceptlens._io as io

    class Full:
        """A file on a disk with no room left: every write past the first bytes fails with ENOSPC."""

        def __init__(self, path, mode):
            self.file = open(path, mode)

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    monkeypatch.setattr(io, "open", Full, raising=False)
    monkeypatch.setattr("torch.save", lambda obj, f, *a, **k: f.write(b"x"))  # through the file, as torch does
    argv = [a.replace("{t}", str(t)) for a in FIT]
    _check(argv + ["--out", str(tmp_path / "run"), "--extractor", "kmeans:n_concepts=3,init_size=32",
                   "--batch-size", "8", "--max-length", "16", "--max-tokens", "300"],
           ["checkpoint.pt", "No space left on device"], capsys)
    assert not list((tmp_path / "run").glob(".checkpoint.pt.*"))  # the partial file is gone


@pytest.mark.parametrize("command", [STEER, SWEEP + ["--alphas", "0", "0.5", "--max-new-tokens", "2"], ABLATE])
def test_steer_sweep_and_ablate_warn_about_another_models_concepts(t, capsys, command):
    argv = [a.replace("{t}", str(t)).replace(f"{t}/set", f"{t}/other") for a in command]
    argv += ["--max-new-tokens", "2"] if command is STEER else ["--max-docs", "2", "--n-controls", "2"] \
        if command is ABLATE else []
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "recorded for model 'other-model'" in err and "this model is 'model'" in err, err


def test_describe_refuses_a_run_whose_model_was_changed(t, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(t / "run", run)
    shutil.copytree(t / "model", tmp_path / "model-b")
    toml = (run / "run.toml").read_text()
    (run / "run.toml").write_text(toml.replace(str(t / "model"), str(tmp_path / "model-b")))
    _check(["describe", str(run)], ["fitted on model 'model'", "'model-b'"], capsys)


def test_a_model_folder_with_custom_code_is_refused_without_a_prompt(t, tmp_path, capsys, monkeypatch):
    import shutil

    folder = tmp_path / "custom"
    shutil.copytree(t / "model", folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="custom-llama", auto_map={"AutoConfig": "modeling_custom.Config",
                                                       "AutoModelForCausalLM": "modeling_custom.Model"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_custom.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    asked = []
    monkeypatch.setattr("builtins.input", lambda *a: asked.append(a) or "y")
    _check(["sites", "--model", str(folder)], ["trust_remote_code"], capsys)
    assert asked == [] and not (tmp_path / "ran").exists()
