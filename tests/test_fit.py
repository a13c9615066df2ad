"""The streaming fit loop: feeding, token hygiene, bad input, checkpoints and resume."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import conceptlens
from conceptlens import ConceptSet
from conceptlens.concepts.kmeans import StreamingKMeans
from tests.conftest import CharTokenizer, assert_same_state, hook_snapshot, tiny_model

ROOT = Path(__file__).resolve().parents[1]
DOCS = [f"text number {i} " + "xyz" * (i % 4) for i in range(40)]


class Recorder:
    """A minimal extractor that keeps what it was fed."""

    def __init__(self) -> None:
        self.batches: list[tuple[torch.Tensor, ...]] = []

    def update(self, *xs):
        self.batches.append(tuple(x.clone() for x in xs))

    def state_dict(self):
        return {"n": len(self.batches)}

    def load_state_dict(self, state):
        pass


@pytest.fixture
def lens():
    return conceptlens.attach(tiny_model("llama"), CharTokenizer())


def test_one_forward_feeds_every_extractor_with_aligned_rows(lens):
    single, pair, other = Recorder(), Recorder(), Recorder()
    report = lens.fit({"blocks.0.resid_out": single, ("blocks.0.resid_out", "blocks.-1.attn.k"): pair,
                       "blocks.1.mlp_out": other}, DOCS, batch_size=8, max_length=16, progress=False,
                      filters=conceptlens.fit.FilterConfig(max_norm_ratio=None))
    real = sum(min(len(d), 16) for d in DOCS)
    assert report.tokens == real and report.documents == len(DOCS) and report.batches == 5
    rows = report.rows["blocks.0.resid_out"]
    assert rows["seen"] == real and rows["first_position"] == len(DOCS) and rows["kept"] == real - len(DOCS)
    assert len(single.batches) == len(pair.batches) == 5
    for (x,), (src, k) in zip(single.batches, pair.batches):
        assert torch.equal(x, src)
        assert k.shape == (x.shape[0], 2, 8)  # pair extractors get q/k per head


def test_checkpoint_dir_gets_concept_sets(lens, tmp_path):
    km = StreamingKMeans(n_concepts=4, init_size=32)
    report = lens.fit({"blocks.1.resid_out": km}, DOCS, max_length=16, checkpoint_dir=str(tmp_path),
                      progress=False)
    cs = ConceptSet.load(tmp_path / "concepts" / "blocks.1.resid_out")
    assert cs.site == "blocks.1.resid_out" and len(cs) == 4
    assert torch.equal(cs.directions, report.concepts["blocks.1.resid_out"].directions)
    assert (tmp_path / "checkpoint.pt").is_file()


def test_nan_and_inf_rows_are_dropped_and_counted(lens):
    model = lens.model
    poisoned = []

    def poison(module, args, output):  # corrupt 3 tokens per forward, after the site is computed
        out = output.clone()
        out[0, 1, 0], out[1, 2, 5], out[-1, 1, :] = float("nan"), float("inf"), float("-inf")
        poisoned.append(3)
        return out

    handle = model.model.layers[0].register_forward_hook(poison)
    try:
        km = StreamingKMeans(n_concepts=3, init_size=16)
        report = lens.fit({"blocks.0.resid_out": km}, DOCS, batch_size=8, max_length=16, progress=False)
    finally:
        handle.remove()
    assert report.rows["blocks.0.resid_out"]["nonfinite"] == sum(poisoned) == 15
    assert all(torch.isfinite(v).all() for v in km.state_dict().values() if isinstance(v, torch.Tensor)
               and v.is_floating_point())


def test_attention_sink_rows_are_dropped_by_norm(lens):
    model = lens.model

    def sink(module, args, output):  # one huge token per row, not at position 0
        out = output.clone()
        out[:, 3] *= 1000
        return out

    handle = model.model.layers[0].register_forward_hook(sink)
    try:
        rec = Recorder()
        report = lens.fit({"blocks.0.resid_out": rec}, DOCS, batch_size=8, max_length=16, progress=False)
    finally:
        handle.remove()
    assert report.rows["blocks.0.resid_out"]["norm_outlier"] == len(DOCS)
    kept = torch.cat([b[0] for b in rec.batches])
    assert kept.norm(dim=1).max() < 100 * kept.norm(dim=1).median()


def test_bad_site_fails_before_any_work(lens):
    consumed = []

    def texts():
        for d in DOCS:
            consumed.append(d)
            yield d

    rec = Recorder()
    snap = hook_snapshot(lens.model)
    with pytest.raises(KeyError, match="blocks 0-1"):
        lens.fit({"blocks.0.resid_out": rec, "blocks.7.resid_out": Recorder()}, texts(), progress=False)
    assert consumed == [] and rec.batches == [] and hook_snapshot(lens.model) == snap
    with pytest.raises(TypeError, match="update"):
        lens.fit({"blocks.0.resid_out": object()}, DOCS, progress=False)
    with pytest.raises(ValueError, match="batch_size"):
        lens.fit({"blocks.0.resid_out": rec}, DOCS, batch_size=0, progress=False)


def test_empty_documents_and_empty_batches_are_harmless(lens):
    rec = Recorder()
    report = lens.fit({"blocks.0.resid_out": rec}, [""] * 9 + ["a", "", "hello there"], batch_size=4,
                      progress=False)
    assert report.tokens == 12 and report.documents == 12
    assert sum(b[0].shape[0] for b in rec.batches) == 10  # position 0 of the two real docs dropped


def test_exception_in_an_extractor_leaves_no_hook(lens):
    class Broken(Recorder):
        def update(self, *xs):
            raise ArithmeticError("boom")

    snap = hook_snapshot(lens.model)
    with pytest.raises(ArithmeticError):
        lens.fit({"blocks.1.resid_out": Broken()}, DOCS, progress=False)
    assert hook_snapshot(lens.model) == snap


def _worker(run_dir: Path, out: Path, kill_after: int | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tests.fit_worker", str(run_dir), str(out)]
    if kill_after is not None:
        cmd.append(str(kill_after))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_sigkilled_fit_resumes_bit_identical(tmp_path):
    whole = _worker(tmp_path / "whole", tmp_path / "whole.pt")
    assert whole.returncode == 0, whole.stderr
    killed = _worker(tmp_path / "run", tmp_path / "never.pt", kill_after=11)
    assert killed.returncode == -9 and not (tmp_path / "never.pt").exists()
    assert (tmp_path / "run" / "checkpoint.pt").is_file()
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.endswith(".tmp")]
    resumed = _worker(tmp_path / "run", tmp_path / "resumed.pt")
    assert resumed.returncode == 0, resumed.stderr
    a, b = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "resumed.pt")
    assert b["resumed_from"] > 0 and a["tokens"] == b["tokens"]
    for key in a["states"]:
        assert_same_state(a["states"][key], b["states"][key])



def test_resume_refuses_a_checkpoint_of_another_fit(lens, tmp_path):
    lens.fit({"blocks.0.resid_out": Recorder()}, DOCS, checkpoint_dir=str(tmp_path), progress=False)
    with pytest.raises(ValueError, match="other sites or extractors"):
        lens.fit({"blocks.1.resid_out": Recorder()}, DOCS, checkpoint_dir=str(tmp_path), progress=False)


def test_resume_names_the_sites_when_a_named_extractor_reads_other_sites(lens, tmp_path):
    lens.fit({"blocks.0.resid_out": {"km": Recorder()}}, DOCS, checkpoint_dir=str(tmp_path), progress=False)
    with pytest.raises(ValueError, match="other sites for its named extractors;"):
        lens.fit({"blocks.1.resid_out": {"km": Recorder()}}, DOCS, checkpoint_dir=str(tmp_path), progress=False)


def test_a_named_crosscoders_checkpoints_resume_from_before_and_after_its_a_plus_b_name(lens, tmp_path):
    from conceptlens.concepts.sae.crosscoder import Crosscoder

    # the form checkpoints written before a two-site crosscoder was named "a+b" hold: they resume
    key = ("blocks.0.resid_out", "blocks.1.resid_out")
    lens.fit({key: {"cc": Crosscoder(width=8, k=2)}}, DOCS, checkpoint_dir=str(tmp_path), max_length=16,
             max_tokens=50, progress=False)
    payload = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert payload["state"]["fingerprint"]["batching"]["sites"] == {"cc": "blocks.0.resid_out->blocks.1.resid_out"}
    # a checkpoint written while the sites were recorded as "a+b" resumes too
    from conceptlens._io import state_digest

    payload["state"]["fingerprint"]["batching"]["sites"] = {"cc": "blocks.0.resid_out+blocks.1.resid_out"}
    payload["sha256"] = state_digest(payload["state"])
    torch.save(payload, tmp_path / "checkpoint.pt")
    again = lens.fit({key: {"cc": Crosscoder(width=8, k=2)}}, DOCS, checkpoint_dir=str(tmp_path), max_length=16,
                     max_tokens=100, progress=False)
    assert again.resumed_from >= 50


def test_resume_refuses_a_checkpoint_whose_rows_had_another_dtype(tmp_path):
    lens = conceptlens.attach(tiny_model("llama").to(torch.bfloat16), CharTokenizer())
    kw = dict(max_length=16, checkpoint_dir=str(tmp_path), progress=False)
    lens.fit({"blocks.0.resid_out": Recorder()}, DOCS, dtype="model", max_tokens=100, **kw)  # bf16 rows
    with pytest.raises(ValueError, match="a fit of other dtype;"):
        lens.fit({"blocks.0.resid_out": Recorder()}, DOCS, **kw)  # float32 rows
    again = lens.fit({"blocks.0.resid_out": Recorder()}, DOCS, dtype=torch.bfloat16, max_tokens=600, **kw)
    assert again.resumed_from >= 100 and again.tokens > again.resumed_from  # the same rows: it resumes


def test_an_extractor_without_concepts_yet_is_reported_not_dropped_silently(lens):
    km = StreamingKMeans(n_concepts=4)
    with pytest.warns(UserWarning, match="no concepts from blocks.0.resid_out"):  # one-token documents:
        report = lens.fit({"blocks.0.resid_out": km}, ["a", "b", "c"], progress=False)  # all sinks
    assert "blocks.0.resid_out" not in report.concepts
    assert "error" in report.stats["blocks.0.resid_out"]


def test_clvq_codes_are_labelled_with_their_encoder_space_not_the_source_site(lens):
    from conceptlens.concepts.clvq import CLVQTranscoder

    tc = CLVQTranscoder(4, hidden=16, batch_size=32, codebook=dict(init_size=32))
    report = lens.fit({("blocks.0.resid_out", "blocks.1.resid_out"): tc}, DOCS, batch_size=8, max_length=16,
                      progress=False)
    cs = next(iter(report.concepts.values()))
    assert cs.site == "blocks.0.resid_out->blocks.1.resid_out:z_e"
    with pytest.raises(KeyError):
        lens.site(cs.site)  # names no activation site: steering or projecting it fails loudly



def test_bf16_model_rows_into_bf16_extractors_and_a_rerun_gives_the_same_concepts(tmp_path):
    from conceptlens.concepts.deleuzian import Deleuzian
    from conceptlens.concepts.sae import TopKSAE

    lens = conceptlens.attach(tiny_model("llama").to(torch.bfloat16), CharTokenizer())
    rec = Recorder()
    lens.fit({"blocks.1.resid_out": rec}, DOCS[:8], max_length=16, progress=False, dtype="model")
    assert rec.batches[0][0].dtype == torch.bfloat16  # what the extractors below are fed

    def make():
        return {"blocks.1.resid_out": {
            "km": StreamingKMeans(n_concepts=4, init_size=32, dtype="bfloat16"),
            "dz": Deleuzian(4, buffer_size=64, batch_size=32, reference_size=64, dtype="bfloat16"),
            "sae": TopKSAE(width=32, k=4, batch_size=64, warmup_tokens=64, dtype="bfloat16"),
            "km32": StreamingKMeans(n_concepts=4, init_size=32)}}  # a float32 extractor fed the same bf16 rows

    kw = dict(max_length=16, checkpoint_dir=str(tmp_path), progress=False, dtype="model")
    extractors = make()
    first = lens.fit(extractors, DOCS, **kw)
    site = extractors["blocks.1.resid_out"]
    assert site["km"]._centres.dtype == torch.float32 and site["sae"].params["W_dec"].dtype == torch.float32
    again = lens.fit(make(), DOCS, **kw)  # the finished run, from its checkpoint
    assert first.concepts.keys() == again.concepts.keys() and len(first.concepts) == 4
    for name, cs in first.concepts.items():
        assert cs.directions.dtype == torch.float32 and torch.isfinite(cs.directions).all()
        assert torch.equal(cs.directions, again.concepts[name].directions), name
