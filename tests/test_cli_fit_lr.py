"""`conceptlens fit` gives an SAE without an lr the lr for its budget (`short_budget_lr`), records it in
run.toml, keeps a given one, and a resumed run keeps the lr it was fitted with."""

from __future__ import annotations

import json

from conceptlens.cli import main
from conceptlens.commands import run_config as rc
from conceptlens.concepts.sae import config as sae_config
from conceptlens.concepts.sae.config import SAEConfig, short_budget_lr
from tests.test_cli_fit import base, files  # noqa: F401 - the fixture: a tiny Llama folder and docs.txt

TOPK = "topk:width=16,k=2,batch_size=64,warmup_tokens=64"  # base()'s SAE: --max-tokens 600 -> 9 steps of 64


def recorded(out) -> dict[str, dict]:
    return {e["name"]: e for e in rc.read_toml(out / "run.toml")["extractor"]}


def fitted_lr(out, name: str = "topk") -> float:
    return json.loads((out / "concepts" / name / "config.json").read_text())["config"]["lr"]


def with_spec(argv: list[str], spec: str) -> list[str]:
    return [spec if a == TOPK else a for a in argv]


def test_an_sae_without_lr_gets_the_budgets_lr_recorded_and_printed(files, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    assert main(base(files, out, "--no-describe")) == 0
    lr = short_budget_lr(16, 600 // 64, 64)
    assert lr != SAEConfig(width=16).learning_rate()  # not the library's long-run rule
    assert recorded(out)["topk"]["lr"] == lr and "lr" not in recorded(out)["km"]  # k-means has no lr
    assert fitted_lr(out) == lr
    line = [s for s in capsys.readouterr().out.splitlines() if s.startswith("  topk: Adam lr")]
    assert len(line) == 1 and f"{lr:.3g}" in line[0] and "about 9 steps of 64 tokens" in line[0]


def test_a_given_lr_wins_and_lr_none_is_the_library_rule(files, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "given"
    assert main(with_spec(base(files, out, "--no-describe"), TOPK + ",lr=0.003")) == 0
    assert recorded(out)["topk"]["lr"] == 0.003 and fitted_lr(out) == 0.003
    assert "Adam lr" not in capsys.readouterr().out
    out = tmp_path / "none"
    assert main(with_spec(base(files, out, "--no-describe"), TOPK + ",lr=none")) == 0
    assert "lr" not in recorded(out)["topk"] and fitted_lr(out) is None  # the config resolves it by width
    assert main(base(files, out, "--no-describe", "--max-tokens", "700")) == 0  # resumed: still the width rule
    assert "lr" not in recorded(out)["topk"]
    assert main(with_spec(base(files, out, "--no-describe", "--max-tokens", "800"), TOPK + ",lr=none")) == 0  # same run
    assert "lr" not in recorded(out)["topk"] and fitted_lr(out) is None


def test_a_resumed_run_keeps_its_lr_and_overwrite_chooses_again(files, tmp_path, capsys, monkeypatch):  # noqa: F811
    out = tmp_path / "run"
    assert main(base(files, out, "--no-describe", "--max-tokens", "300")) == 0
    first = short_budget_lr(16, 300 // 64, 64)
    assert recorded(out)["topk"]["lr"] == first
    capsys.readouterr()
    monkeypatch.setattr(sae_config, "short_budget_lr", lambda width, steps, batch_size: 0.5)  # the rule now differs
    assert main(base(files, out, "--no-describe", "--max-tokens", "1200")) == 0  # resumes: not another run
    assert recorded(out)["topk"]["lr"] == first and fitted_lr(out) == first
    assert json.loads((out / "fit_report.json").read_text())["tokens"] >= 1200
    printed = capsys.readouterr().out
    assert "for this budget" not in printed and f"  topk: Adam lr {first:.3g} as {out / 'run.toml'} records it" in printed
    assert main(base(files, out, "--no-describe", "--max-tokens", "600", "--no-resume")) == 0  # restarts, same run
    assert recorded(out)["topk"]["lr"] == first and f"Adam lr {first:.3g} as" in capsys.readouterr().out
    assert main(base(files, out, "--no-describe", "--max-tokens", "1200", "--overwrite")) == 0
    assert recorded(out)["topk"]["lr"] == 0.5 and fitted_lr(out) == 0.5


def test_the_written_run_toml_reads_back_with_the_same_lr(files, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    assert main(base(files, out, "--no-describe")) == 0
    cfg = rc.from_dict(rc.read_toml(out / "run.toml"))  # what describe and a resume read
    assert rc.budget_lrs(cfg) == {}  # it names its lr: nothing left to choose
    assert [e.get("lr") for e in cfg.extractors] == [None, short_budget_lr(16, 600 // 64, 64)]


def test_a_bad_width_or_batch_still_gets_the_constructors_one_line_error(files, tmp_path, capsys):  # noqa: F811
    for spec, message in (("topk:width=abc,k=2", "width must be a positive integer; got 'abc'"),
                          ("topk:width=16,k=2,batch_size=0", "batch_size must be a positive integer; got 0"),
                          ("topk:width=16,k=2,batch_size=true", "batch_size must be a positive integer; got True")):
        assert main(with_spec(base(files, tmp_path / "bad"), spec)) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err and not (tmp_path / "bad").exists()


def test_an_extractor_with_its_own_budget_gets_the_lr_for_it_and_stops_there(files, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "own"
    assert main(with_spec(base(files, out, "--no-describe"), TOPK + ",max_tokens=300")) == 0
    lr = short_budget_lr(16, 300 // 64, 64)
    assert recorded(out)["topk"]["lr"] == lr and recorded(out)["topk"]["max_tokens"] == 300
    line = [s for s in capsys.readouterr().out.splitlines() if s.startswith("  topk: Adam lr")]
    assert len(line) == 1 and "about 4 steps of 64 tokens" in line[0]
    fit = lambda name: json.loads((out / "concepts" / name / "config.json").read_text())["config"]["fit"]["tokens"]
    report = json.loads((out / "fit_report.json").read_text())
    assert 300 <= fit("topk") < 300 + 8 * 16 and fit("km") == report["tokens"] >= 600  # a batch is 8 x 16 tokens at most
    assert main(base(files, tmp_path / "bad", "--no-describe", "--extractor", "kmeans:n_concepts=4,max_tokens=0,name=k2")) == 2
    err = capsys.readouterr().err.strip()
    assert "extractor 'k2' max_tokens" in err and "\n" not in err and not (tmp_path / "bad").exists()
