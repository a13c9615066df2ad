"""Corrupt and hostile files: flipped bits, pickles that would run code, checkpoints of the wrong shape."""

from __future__ import annotations

import builtins
import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch

import conceptlens
from conceptlens import ConceptSet
from conceptlens.concepts.kmeans import StreamingKMeans
from tests.conftest import CharTokenizer, assert_same_state, tiny_model
from tests.faults import one_line_error

DOCS = [f"text {i} " + "qrstuvw"[i % 5:] * (1 + i % 3) for i in range(24)]
SITE = "blocks.1.resid_out"
CHECKPOINT = "checkpoint.pt"


def _fit(lens, run: Path, data=DOCS, km=None, **kw):
    km = km or StreamingKMeans(n_concepts=3, init_size=16, seed=2)
    report = lens.fit({SITE: km}, data, batch_size=6, max_length=20, checkpoint_dir=str(run), progress=False, **kw)
    return km, report


def checkpoint_of(run: Path) -> bytes:
    """Fit the tiny Llama over DOCS with a checkpoint in `run`; the checkpoint's bytes."""
    torch.manual_seed(0)
    _fit(conceptlens.attach(tiny_model("llama"), CharTokenizer()), run)
    return (run / CHECKPOINT).read_bytes()


@pytest.fixture(scope="module")
def lens():
    return conceptlens.attach(tiny_model("llama"), CharTokenizer())


@pytest.fixture(scope="module")
def reference(lens, tmp_path_factory):
    """A checkpoint's bytes and the extractor state a resume from it ends with."""
    run = tmp_path_factory.mktemp("ref")
    raw = checkpoint_of(run)
    km, report = _fit(lens, run)
    assert report.resumed_from > 0
    return raw, km.state_dict()


def _one_line_value_error(fn, *names: str) -> str:
    return one_line_error(ValueError, fn, *names)


def _flips(size: int, n: int = 40) -> list[tuple[int, int]]:
    """n (byte, bit) positions spread evenly over a file of `size` bytes."""
    return [(int((i + 0.5) * size / n), i % 8) for i in range(n)]


def _flip(raw: bytes, at: int, bit: int) -> bytes:
    out = bytearray(raw)
    out[at] ^= 1 << bit
    return bytes(out)


def test_checkpoint_bit_flips_never_resume_with_other_parameters(lens, reference, tmp_path):
    raw, expected = reference
    silent = []
    for n, (at, bit) in enumerate(_flips(len(raw))):
        run = tmp_path / str(n)
        run.mkdir()
        (run / CHECKPOINT).write_bytes(_flip(raw, at, bit))
        try:
            km, _ = _fit(lens, run)
        except ValueError as err:
            assert "\n" not in str(err) and CHECKPOINT in str(err), err
            continue
        try:
            assert_same_state(expected, km.state_dict())
        except AssertionError:
            silent.append(at)
    assert silent == [], f"{len(silent)} of 40 flipped checkpoints resumed with other parameters (bytes {silent})"


def _saved_set(folder: Path) -> ConceptSet:
    g = torch.Generator().manual_seed(3)
    cs = ConceptSet(torch.randn(6, 16, generator=g), site="blocks.1.resid_out", method="sae", model="tiny",
                    config={"k": 4}, encoder={"W_enc": torch.randn(16, 6, generator=g)},
                    stats={"freq": torch.rand(6, generator=g)})
    cs.save(folder)
    return cs


def _same_set(a: ConceptSet, b: ConceptSet) -> bool:
    return (torch.equal(a.directions, b.directions) and a.site == b.site and a.model == b.model
            and a.method == b.method and a.config == b.config and a.encoder.keys() == b.encoder.keys()
            and all(torch.equal(a.encoder[k], b.encoder[k]) for k in a.encoder)
            and a.stats.keys() == b.stats.keys() and all(torch.equal(a.stats[k], b.stats[k]) for k in a.stats))


@pytest.mark.parametrize("name", ["concepts.safetensors", "config.json"])
def test_concept_set_bit_flips_never_load_another_set(tmp_path, name):
    original = _saved_set(tmp_path / "set")
    path = tmp_path / "set" / name
    raw = path.read_bytes()
    silent = []
    for at, bit in _flips(len(raw)):
        path.write_bytes(_flip(raw, at, bit))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loaded = ConceptSet.load(tmp_path / "set")
        except ValueError as err:
            assert "\n" not in str(err) and ("concepts.safetensors" in str(err) or "config.json" in str(err)), err
            continue
        if not _same_set(original, loaded):
            silent.append(at)
    assert silent == [], f"{len(silent)} of 40 flips in {name} loaded as another set (bytes {silent})"


class Hostile:
    """Unpickling this would create a file: proof that code ran."""

    marker: Path

    def __reduce__(self):
        return builtins.open, (str(self.marker), "w")


@pytest.mark.parametrize("writer", ["pickle", "torch.save"])
def test_a_hostile_checkpoint_is_refused_in_one_line_and_never_runs(lens, tmp_path, writer):
    Hostile.marker = tmp_path / "pwned"
    run = tmp_path / "run"
    run.mkdir()
    payload = {"format": "conceptlens.fit-checkpoint", "version": 2, "state": Hostile()}
    if writer == "pickle":
        (run / CHECKPOINT).write_bytes(pickle.dumps(payload))
    else:
        torch.save(payload, run / CHECKPOINT)
    _one_line_value_error(lambda: _fit(lens, run), "cannot read checkpoint")
    assert not Hostile.marker.exists()


def test_a_hostile_concept_file_is_refused_and_never_runs(tmp_path):
    Hostile.marker = tmp_path / "pwned"
    folder = tmp_path / "set"
    _saved_set(folder)
    (folder / "concepts.safetensors").write_bytes(pickle.dumps(Hostile()))
    _one_line_value_error(lambda: ConceptSet.load(folder), "concepts.safetensors")
    assert not Hostile.marker.exists()


def _rewrite(run: Path, change) -> None:
    """Change a checkpoint's state and store it with a valid checksum (a well-formed file
    of the wrong structure, not a corrupt one)."""
    payload = torch.load(run / CHECKPOINT, weights_only=True)
    if "sha256" in payload:
        from conceptlens._io import state_digest

        change(payload["state"])
        payload["sha256"] = state_digest(payload["state"])
    else:  # a checkpoint without checksum (written before version 2)
        change(payload)
    torch.save(payload, run / CHECKPOINT)


def _wrong_width(state):
    km = state["extractors"][SITE]
    km["d"], km["centres"] = 7, km["centres"][:, :7].clone()


@pytest.mark.parametrize("change, names", [
    (lambda s: s.pop("progress"), ["lacks 'progress'"]),
    (lambda s: s["extractors"].clear(), ["holds extractors []", SITE]),
    (lambda s: s["extractors"][SITE].pop("centres"), [SITE, "does not load"]),
    (_wrong_width, ["width 7", "width 32"]),
    (lambda s: s.update(torch_rng=torch.zeros(10, dtype=torch.uint8)), ["torch_rng is not a torch RNG state"]),
    (lambda s: s["progress"].update(documents=-3), ["progress"]),
], ids=["missing-key", "missing-extractor", "missing-extractor-key", "wrong-width", "bad-rng", "bad-progress"])
def test_a_checkpoint_of_the_wrong_structure_fails_before_any_work(lens, tmp_path, change, names):
    run = tmp_path / "run"
    checkpoint_of(run)
    _rewrite(run, change)
    consumed = []

    def texts():
        for doc in DOCS:
            consumed.append(doc)
            yield doc

    km = StreamingKMeans(n_concepts=3, init_size=16, seed=2)
    fresh = km.state_dict()
    rng = torch.get_rng_state()
    _one_line_value_error(lambda: _fit(lens, run, texts(), km), CHECKPOINT, *names)
    assert consumed == []
    assert_same_state(fresh, km.state_dict())
    assert torch.equal(rng, torch.get_rng_state())


def test_a_folder_where_the_checkpoint_should_be_fails_before_any_work(lens, tmp_path):
    (tmp_path / CHECKPOINT).mkdir()
    consumed = []

    def texts():
        for doc in DOCS:
            consumed.append(doc)
            yield doc

    for resume in (True, False):
        _one_line_value_error(lambda: _fit(lens, tmp_path, texts(), resume=resume), "is a folder")
    assert consumed == []


def test_a_concept_config_without_a_key_names_the_key(tmp_path):
    folder = tmp_path / "set"
    _saved_set(folder)
    config = json.loads((folder / "config.json").read_text())
    del config["site"]
    (folder / "config.json").write_text(json.dumps(config))  # config.json edited: the copies disagree
    _one_line_value_error(lambda: ConceptSet.load(folder), "'site'")
    from safetensors.torch import save_file  # a version-1 set: config.json is the only config

    config["format_version"] = 1
    del config["sha256"]
    save_file({"directions": torch.ones(6, 16)}, folder / "concepts.safetensors",
              metadata={"format": "conceptlens.ConceptSet"})
    config.update(encoder_keys=[], stats_keys=[])
    (folder / "config.json").write_text(json.dumps(config))
    _one_line_value_error(lambda: ConceptSet.load(folder), "lacks the key 'site'")


def test_a_checkpoint_dir_that_cannot_be_written_fails_before_any_work(lens, tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    consumed = []

    def texts():
        for doc in DOCS:
            consumed.append(doc)
            yield doc

    _one_line_value_error(lambda: _fit(lens, tmp_path / "a_file", texts()), "a_file", "cannot be written",
                          "is a file")
    _one_line_value_error(lambda: _fit(lens, tmp_path / "a_file" / "run", texts()), "cannot be written")
    _one_line_value_error(lambda: _fit(lens, Path("/proc/conceptlens-run"), texts()), "cannot be written")
    assert consumed == []


@pytest.mark.parametrize("framework", ["pt", "numpy"])
def test_a_damaged_safetensors_file_is_one_line_naming_it_and_what_to_do(tmp_path, framework):
    from safetensors.torch import save_file

    from conceptlens._io import read_safetensors

    path = tmp_path / "stats.safetensors"
    save_file({"a": torch.arange(6.0), "b": torch.ones(2, 3)}, path, metadata={"format": "x"})
    tensors, metadata = read_safetensors(path, framework)
    assert metadata == {"format": "x"} and sorted(tensors) == ["a", "b"] and tensors["a"].tolist() == list(range(6))
    for damaged in (path.read_bytes()[:40], b"\xff" * 7, b""):
        path.write_bytes(damaged)
        with pytest.raises(ValueError) as err:
            read_safetensors(path, framework, "run describe again")
        message = str(err.value)
        assert message.startswith(f"{path} is not a readable safetensors file (") and "\n" not in message
        assert message.endswith("): run describe again")
