"""Several named extractors per site in one fit; name collisions are errors, not silent drops."""

from __future__ import annotations

import pytest
import torch

import conceptlens
from conceptlens.concepts.kmeans import StreamingKMeans
from tests.conftest import CharTokenizer, tiny_model
from tests.test_fit import DOCS, Recorder


@pytest.fixture
def lens():
    return conceptlens.attach(tiny_model("llama"), CharTokenizer())


def test_one_site_feeds_several_named_extractors_the_same_rows(lens):
    a, b, c = Recorder(), Recorder(), Recorder()
    report = lens.fit({"blocks.1.resid_out": {"a": a, "b": b}, "blocks.0.resid_out": c}, DOCS, batch_size=8,
                      max_length=16, progress=False)
    assert len(a.batches) == len(b.batches) == len(c.batches) == 5
    for (x,), (y,) in zip(a.batches, b.batches):
        assert torch.equal(x, y)
    assert set(report.stats) == {"a", "b", "blocks.0.resid_out"}


def test_named_extractors_are_saved_under_their_names(lens, tmp_path):
    kms = {"km4": StreamingKMeans(n_concepts=4, init_size=32), "km3": StreamingKMeans(n_concepts=3, init_size=32)}
    report = lens.fit({"blocks.-1.resid_out": kms}, DOCS, max_length=16, checkpoint_dir=str(tmp_path),
                      progress=False)
    assert set(report.concepts) == {"km4", "km3"}
    for name, n in (("km4", 4), ("km3", 3)):
        cs = conceptlens.ConceptSet.load(tmp_path / "concepts" / name)
        assert len(cs) == n and cs.site == "blocks.1.resid_out"


def test_two_keys_for_one_site_are_an_error_not_a_silent_drop(lens):
    with pytest.raises(ValueError, match="two extractors are named 'blocks.1.resid_out'"):
        lens.fit({"blocks.1.resid_out": Recorder(), "blocks.-1.resid_out": Recorder()}, DOCS, progress=False)
    with pytest.raises(ValueError, match="two extractors are named 'x'"):
        lens.fit({"blocks.1.resid_out": {"x": Recorder()}, "blocks.-1.resid_out": {"x": Recorder()}}, DOCS,
                 progress=False)
    with pytest.raises(ValueError, match="two extractors are named 'x'"):  # one name at two sites
        lens.fit({"blocks.0.resid_out": {"x": Recorder()}, "blocks.1.resid_out": {"x": Recorder()}}, DOCS,
                 progress=False)


@pytest.mark.parametrize("name", ["a/b", "..", ".", ".hidden", "/abs", "a'b"])
def test_unsafe_names_are_refused(lens, name):
    with pytest.raises(ValueError, match=f"{name!r} .* not a safe folder name"):
        lens.fit({"blocks.1.resid_out": {name: Recorder()}}, DOCS, progress=False)


def test_named_extractors_resume_from_their_checkpoint(lens, tmp_path):
    def run(max_tokens):
        kms = {"p": StreamingKMeans(n_concepts=4, init_size=32, seed=1),
               "q": StreamingKMeans(n_concepts=4, init_size=32, seed=2)}
        lens.fit({"blocks.1.resid_out": kms}, DOCS, batch_size=4, max_length=16, max_tokens=max_tokens,
                 checkpoint_dir=str(tmp_path), progress=False)
        return kms

    run(150)
    resumed = run(None)
    import shutil
    shutil.rmtree(tmp_path)
    whole = run(None)
    for name in ("p", "q"):
        assert torch.equal(resumed[name].centres, whole[name].centres)
