"""The CLI takes sites in the library's own vocabulary: every site a model lists is accepted,
and a name that is no site fails once the model is attached, with the model's valid names."""

from __future__ import annotations

import re

import pytest

import conceptlens
from conceptlens.cli import main
from conceptlens.commands import run_config as rc
from tests.adapters.tiny_configs import build
from tests.conftest import tiny_model
from tests.test_cli_fit import base, files  # noqa: F401 (the fixture: a saved tiny Llama and documents)


def _config(sites: list[str]) -> rc.RunConfig:
    return rc.from_dict({"model": "m", "data": "d", "sites": sites, "extractor": [{"method": "kmeans"}]})


@pytest.mark.parametrize("model", [lambda: tiny_model("llama"), lambda: tiny_model("t5"), lambda: build("mamba2"),
                                   lambda: build("bamba")], ids=["llama", "t5", "mamba2", "bamba"])
def test_every_site_a_model_lists_passes_the_cli_config_check(model):
    lens = conceptlens.attach(model())
    names = list(lens.sites)
    # the spellings the old regex refused are among them (one model or another has each)
    assert _config(names).sites == names
    for name in names:  # and each one resolves to itself through the library's resolver
        assert lens.site(name).name == name


def test_sites_the_old_pattern_refused_are_listed_by_the_tiny_models():
    seen = set()
    for model in (tiny_model("llama"), tiny_model("t5"), build("mamba2")):
        seen |= {re.sub(r"^.*blocks\.\d+\.", "", name) for name in conceptlens.attach(model).sites}
    assert {"attn.z", "attn.pattern", "mlp.post", "attn.q_pre", "cross_attn_out", "mixer_out"} <= seen


def test_fit_reads_a_site_only_the_resolver_knows(files, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    argv = [a if a != "blocks.1.resid_out" else "blocks.1.attn.z" for a in base(files, out, "--no-describe")]
    argv = [a for i, a in enumerate(argv) if not (a.startswith("topk") or (a == "--extractor" and
                                                                          argv[i + 1].startswith("topk")))]
    assert main(argv) == 0, capsys.readouterr().err
    assert "blocks.1.attn.z" in (out / "run.toml").read_text()


@pytest.mark.parametrize("site, message", [
    ("blocks.1.resid", "no site 'blocks.1.resid'; close valid names: ['blocks.1.resid_in'"),
    ("blocks.7.resid_out", "no site 'blocks.7.resid_out'; the model has blocks 0-1, e.g. 'blocks.1.resid_out'"),
    ("blocks.1.attn.zz", "no site 'blocks.1.attn.zz': block 1 of llama has no attn.zz (its sites: ['attn.k'"),
])
def test_a_bad_site_is_one_line_with_the_valid_choices(files, tmp_path, capsys, site, message):  # noqa: F811
    argv = [a if a != "blocks.1.resid_out" else site for a in base(files, tmp_path / "bad")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("conceptlens fit: error:") and message in err and "\n" not in err
    assert not (tmp_path / "bad").exists()
