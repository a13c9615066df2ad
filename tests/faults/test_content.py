"""Loaded states checked by their content: shapes against the site, finite values, integer
ranges, JSON types and nesting depth, even in files whose checksums were recomputed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conceptlens import ConceptSet
from conceptlens._io import tensor_digest
from conceptlens.concepts.kmeans import StreamingKMeans
from conceptlens.concepts.sae import TopKSAE, export_saelens, import_saelens, sae_from_concept_set
from tests.faults import one_line_error
from tests.faults.test_integrity import CHECKPOINT, DOCS, SITE, _fit, _rewrite, _saved_set, checkpoint_of, lens  # noqa: F401


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def _narrow_centres(state):  # the declared d stays the site's width; the tensor does not
    km = state["extractors"][SITE]
    km["centres"] = km["centres"][:, :7].clone()


def _nan_centres(state):
    state["extractors"][SITE]["centres"][0, 0] = float("nan")


def _deep(state):
    state["extractors"][SITE]["notes"] = _nested(3000)


@pytest.mark.parametrize("change, names", [
    (_narrow_centres, ["width 7", "width 32"]),
    (_nan_centres, ["centres", "NaN"]),
    (lambda s: s.update(world_size=1, ranks=[3]), ["ranks/0"]),
    (lambda s: s.update(world_size=1, ranks=[]), ["ranks holds 0", "world_size says 1"]),
    (lambda s: s.update(world_size="1", ranks=[dict(s)]), ["world_size"]),
    (_deep, ["nested deeper than"]),
], ids=["narrow-centres", "nan-centres", "rank-not-a-dict", "ranks-short", "world-size-str", "deep"])
def test_a_resealed_checkpoint_is_checked_by_content(lens, tmp_path, change, names):  # noqa: F811
    run = tmp_path / "run"
    checkpoint_of(run)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # only so the hostile file can be written
    try:
        _rewrite(run, change)
    finally:
        sys.setrecursionlimit(limit)
    km = StreamingKMeans(n_concepts=3, init_size=16, seed=2)
    hostile = (run / CHECKPOINT).read_bytes()
    one_line_error(ValueError, lambda: _fit(lens, run, DOCS, km), CHECKPOINT, *names)
    assert (run / CHECKPOINT).read_bytes() == hostile  # refused, not replaced: the user decides what to keep


def _reseal(folder: Path, change_config=None, change_tensors=None) -> None:
    """Rewrite a saved set with a changed config or tensors and a recomputed sha256."""
    path = folder / "concepts.safetensors"
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    config = json.loads(meta["config"])
    if change_tensors:
        change_tensors(tensors)
    if change_config:
        change_config(config)
    config["sha256"] = tensor_digest(tensors)
    text = json.dumps(config)
    save_file(tensors, path, metadata={**meta, "config": text})
    (folder / "config.json").write_text(text)


def _set(key, value):
    return lambda c: c.__setitem__(key, value)


def _inner(key, value):
    return lambda c: c["config"].__setitem__(key, value)


@pytest.mark.parametrize("config, tensors, names", [
    (None, lambda t: t["directions"].__setitem__((0, 0), float("nan")), ["directions", "NaN"]),
    (None, lambda t: t["encoder.W_enc"].__setitem__((1, 1), float("inf")), ["encoder.W_enc", "NaN or infinite"]),
    (_inner("k", -3), None, ["config.k", "-3"]),
    (_inner("k", 10**9), None, ["config.k", "1000000000"]),
    (_set("n_concepts", "6"), None, ["n_concepts", "an integer"]),
    (_set("config", [1, 2]), None, ["config must be an object"]),
    (_set("site", 5), None, ["site must be a string"]),
    (_set("encoder_keys", "W_enc"), None, ["encoder_keys"]),
    (_inner("x", _nested(200)), None, ["nested deeper than"]),
], ids=["nan-direction", "inf-encoder", "k-negative", "k-huge", "n-str", "config-list", "site-int", "keys-str",
        "deep"])
def test_a_resealed_concept_set_is_checked_by_content(tmp_path, config, tensors, names):
    folder = tmp_path / "set"
    _saved_set(folder)
    _reseal(folder, config, tensors)
    message = one_line_error(ValueError, lambda: ConceptSet.load(folder), "concepts.safetensors", *names)
    assert str(folder) in message  # which set on disk is bad, not only which field


def test_a_deeply_nested_config_json_is_one_line_not_a_recursion_error(tmp_path):
    from conceptlens._content import parse_json

    one_line_error(ValueError, lambda: parse_json("[" * 100_000, "x.json"), "x.json", "nested deeper")


def _exported(folder: Path) -> None:
    sae = TopKSAE(width=16, k=3, batch_size=100, warmup_tokens=100, buffer_size=100, seed=0)
    sae.update(3 + 2 * torch.randn(500, 12, generator=torch.Generator().manual_seed(0)))
    export_saelens(sae, folder)


def _cfg(change):
    def edit(folder: Path) -> None:
        cfg = json.loads((folder / "cfg.json").read_text())
        (folder / "cfg.json").write_text(json.dumps(change(cfg)))
    return edit


def _weights(change):
    def edit(folder: Path) -> None:
        from safetensors.torch import load_file

        w = load_file(folder / "sae_weights.safetensors")
        change(w)
        save_file(w, folder / "sae_weights.safetensors")
    return edit


@pytest.mark.parametrize("edit, names", [
    (_cfg(lambda c: [c]), ["cfg.json", "must be an object"]),
    (_cfg(lambda c: {**c, "k": -3}), ["cfg.json", "k must be an integer in [1, 16]"]),
    (_cfg(lambda c: {**c, "k": 10**9}), ["cfg.json", "k must be"]),
    (_cfg(lambda c: {**c, "d_sae": "16"}), ["cfg.json", "d_sae"]),
    (_cfg(lambda c: {**c, "metadata": "x"}), ["cfg.json", "metadata"]),
    (_cfg(lambda c: {**c, "model_from_pretrained_kwargs": [1]}), ["cfg.json", "model_from_pretrained_kwargs"]),
    (_weights(lambda w: w["W_dec"].__setitem__((0, 0), float("nan"))), ["sae_weights.safetensors", "W_dec"]),
], ids=["list", "k-negative", "k-huge", "d-sae-str", "metadata-str", "kwargs-list", "nan-weight"])
def test_a_saelens_folder_is_checked_by_content(tmp_path, edit, names):
    _exported(tmp_path)
    edit(tmp_path)
    one_line_error(ValueError, lambda: import_saelens(tmp_path), *names)


def test_an_sae_is_rebuilt_only_from_finite_whole_sets():
    sae = TopKSAE(width=16, k=3, batch_size=100, warmup_tokens=100, buffer_size=100, seed=0)
    sae.update(3 + 2 * torch.randn(500, 12, generator=torch.Generator().manual_seed(0)))
    cs = sae.concept_set()
    cs.encoder["W_enc"][0, 0] = float("nan")
    one_line_error(ValueError, lambda: sae_from_concept_set(cs), "encoder.W_enc", "NaN")
    one_line_error(ValueError, lambda: sae_from_concept_set(sae.concept_set()[:4]), "subset")


def test_infinities_may_mark_empty_slots_but_nan_is_refused_anywhere_in_a_state():
    from conceptlens._content import check_no_nan

    check_no_nan("ckpt", "describer", {"top": [torch.tensor([3.0, -float("inf")])], "count": torch.tensor(2)})
    one_line_error(ValueError, lambda: check_no_nan("ckpt", "describer", {"top": [torch.tensor([float("nan")])]}),
                   "ckpt", "describer/top/0", "1 NaN")
