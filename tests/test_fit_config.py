"""One fit configuration: `FitConfig` is what `Lens.fit`, `describe` and the CLI's [fit] table take;
keyword overrides are its fields, and nothing else."""

from __future__ import annotations

import dataclasses

import pytest

import conceptlens
from conceptlens.commands.run_config import FitSection
from conceptlens.concepts.kmeans import StreamingKMeans
from conceptlens.filters import FilterConfig
from conceptlens.fit import FitConfig, fit_config
from tests.conftest import CharTokenizer, tiny_model
from tests.test_fit import DOCS, Recorder


def test_overrides_replace_fields_and_are_checked_like_the_config():
    base = FitConfig(batch_size=4, max_tokens=100)
    assert fit_config(base, max_length=32) == FitConfig(batch_size=4, max_tokens=100, max_length=32)
    assert fit_config() == FitConfig() and fit_config(None, filters=None).filters == FilterConfig()
    with pytest.raises(ValueError, match="batch_size must be a positive integer; got 0"):
        fit_config(base, batch_size=0)
    with pytest.raises(TypeError, match=r"Lens.fit\(\) got unknown keyword argument 'batchsize' \(did you mean "
                                        r"'batch_size'\?\); valid: batch_size, max_length, max_tokens"):
        fit_config(base, "Lens.fit", batchsize=8)


@pytest.mark.parametrize("field, value, message", [
    ("filters", {"first_position": False}, "filters must be a FilterConfig"),
    ("resume", "no", "resume must be True or False; got 'no'"),
    ("progress", 1, "progress must be True or False; got 1"),
    ("dtype", "bfloat16", "dtype must be a floating torch dtype"),
    ("checkpoint_dir", "", "checkpoint_dir must be a folder path, or None for no checkpoint; got ''"),
    ("checkpoint_dir", 3, "checkpoint_dir must be a folder path, or None for no checkpoint; got 3"),
])
def test_a_field_of_the_wrong_type_is_refused_in_one_line_naming_it(field, value, message):
    with pytest.raises(ValueError, match=message):
        FitConfig(**{field: value})
    with pytest.raises(ValueError, match=message):
        fit_config(None, **{field: value})  # the keywords of Lens.fit


def test_lens_fit_takes_a_config_and_every_field_as_an_override():
    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    by_config, by_keywords = Recorder(), Recorder()
    a = lens.fit({"blocks.1.resid_out": by_config}, DOCS, config=FitConfig(batch_size=4, max_tokens=120, progress=False))
    b = lens.fit({"blocks.1.resid_out": by_keywords}, DOCS, batch_size=4, max_tokens=120, progress=False)
    assert (a.tokens, a.batches) == (b.tokens, b.batches) and a.batches == len(by_config.batches) > 1
    config = FitConfig(progress=False)  # the config's fields are the only keywords: a new field needs no other edit
    for f in dataclasses.fields(FitConfig):
        if f.name not in ("checkpoint_dir", "checkpoint_every", "distributed"):
            lens.fit({"blocks.1.resid_out": Recorder()}, DOCS[:2], config=config, **{f.name: getattr(config, f.name)})
    with pytest.raises(TypeError, match="unknown keyword argument 'batchsize'"):
        lens.fit({"blocks.1.resid_out": Recorder()}, DOCS, batchsize=4)


def test_describe_streams_with_the_same_config(tmp_path):
    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    km = StreamingKMeans(n_concepts=2, init_size=16, seed=0)
    report = lens.fit({"blocks.1.resid_out": {"km": km}}, DOCS, max_tokens=200, progress=False)
    sets = {"km": report.concepts["km"]}
    a = lens.describe(sets, DOCS, top_n=2, fit=FitConfig(batch_size=4, max_tokens=60, progress=False))
    b = lens.describe(sets, DOCS, top_n=2, batch_size=4, max_tokens=60, progress=False)
    assert a["km"].info["tokens"] == b["km"].info["tokens"] >= 60
    with pytest.raises(TypeError, match="describe\\(\\) got unknown keyword argument 'max_token'"):
        lens.describe(sets, DOCS, max_token=60)


def test_the_cli_fit_table_is_a_part_of_fit_config_with_its_defaults():
    config = FitConfig()
    for f in dataclasses.fields(FitSection):
        assert getattr(FitSection(), f.name) == getattr(config, f.name), f.name
