"""A checkpoint resumes only the fit that wrote it: same model weights and depth, same data."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import conceptlens
from conceptlens.concepts.kmeans import StreamingKMeans
from conceptlens.fit import FitReport
from tests.conftest import CONFIGS, CharTokenizer, assert_same_state, tiny_model

DOCS = [f"text {i} " + "qrstuvw"[i % 5:] * (1 + i % 3) for i in range(24)]
SITE = "blocks.1.resid_out"


def _fit(model, run, data=DOCS, extractors=None):
    extractors = extractors or {SITE: StreamingKMeans(n_concepts=3, init_size=16, seed=2)}
    report = conceptlens.attach(model, CharTokenizer()).fit(extractors, data, batch_size=6, max_length=20,
                                                            checkpoint_dir=str(run), progress=False)
    return extractors, report


def _refused(model, run, data=DOCS, what: str = "") -> None:
    km = StreamingKMeans(n_concepts=3, init_size=16, seed=2)
    fresh = km.state_dict()
    with pytest.raises(ValueError, match=what) as info:
        _fit(model, run, data, {SITE: km})
    assert "\n" not in str(info.value) and "resume=False" in str(info.value)
    assert_same_state(fresh, km.state_dict())


def test_the_same_fit_resumes(tmp_path):
    _fit(tiny_model("llama"), tmp_path)
    _, report = _fit(tiny_model("llama"), tmp_path)
    assert report.resumed_from > 0


def test_other_texts_of_the_same_type_are_refused(tmp_path):
    _fit(tiny_model("llama"), tmp_path)
    _refused(tiny_model("llama"), tmp_path, DOCS[:5] + ["another text"] + DOCS[6:], "other data")


def test_a_changed_file_at_the_same_path_is_refused(tmp_path):
    path = tmp_path / "texts.txt"
    path.write_text("\n".join(DOCS))
    _fit(tiny_model("llama"), tmp_path / "run", str(path))
    path.write_text("\n".join(reversed(DOCS)))
    _refused(tiny_model("llama"), tmp_path / "run", str(path), "other data")


def test_fewer_texts_than_the_checkpoint_consumed_are_refused(tmp_path):
    _fit(tiny_model("llama"), tmp_path)
    _refused(tiny_model("llama"), tmp_path, DOCS[:10], "other data")


def test_a_model_with_other_weights_of_the_same_architecture_is_refused(tmp_path):
    _fit(tiny_model("llama", seed=0), tmp_path)
    _refused(tiny_model("llama", seed=1), tmp_path, what="another model")


def test_a_model_of_another_depth_with_the_same_class_is_refused(tmp_path):
    _fit(tiny_model("llama"), tmp_path)
    config = CONFIGS["llama"]()
    config.num_hidden_layers = 3
    torch.manual_seed(0)
    deeper = tf.AutoModelForCausalLM.from_config(config).eval()
    assert type(deeper) is type(tiny_model("llama"))
    _refused(deeper, tmp_path, what="another model")


def test_a_refused_resume_leaves_every_extractor_as_it_was(tmp_path):
    first = {"blocks.0.resid_out": StreamingKMeans(n_concepts=3, init_size=16, seed=2),
             SITE: StreamingKMeans(n_concepts=3, init_size=16, seed=2)}
    _fit(tiny_model("llama"), tmp_path, extractors=first)
    again = {"blocks.0.resid_out": StreamingKMeans(n_concepts=3, init_size=16, seed=2),
             SITE: StreamingKMeans(n_concepts=5, init_size=16, seed=2)}  # same type, another config
    fresh = {k: e.state_dict() for k, e in again.items()}
    with pytest.raises(ValueError, match=f"{SITE} does not load: .*; resume with the settings it was written with, "
                       r"or start again with resume=False \(--no-resume on the command line\)"):
        _fit(tiny_model("llama"), tmp_path, extractors=again)
    for key, extractor in again.items():
        assert_same_state(fresh[key], extractor.state_dict())


def test_the_summary_rate_after_a_resume_counts_this_calls_tokens():
    report = FitReport(tokens=1000, documents=10, batches=2, seconds=2.0, resumed_from=800, rows={},
                       stats={})
    assert "(100 tok/s)" in report.summary() and "200 after resuming at 800" in report.summary()
    fresh = FitReport(tokens=1000, documents=10, batches=2, seconds=2.0, resumed_from=0, rows={}, stats={})
    assert "(500 tok/s)" in fresh.summary()
