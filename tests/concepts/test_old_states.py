"""Checkpoints, fit checkpoints and concept sets of k-means, VQ, CLVQ and Deleuzian written by
older code (tests/concepts/data/old_states.py, commit b2b0d37) load exactly and resume to what
that code produced (within float tolerance: the files were written on another run)."""

from pathlib import Path

import pytest
import torch

from conceptlens.concepts import ConceptSet
from tests.concepts.data.old_states import CASES, CUT, FIT, TEXTS, feed, fit_state, make, merged, stream, written
from tests.conftest import assert_same_state

V1 = Path(__file__).parent / "data" / "v1"


def without_key_biases(state):
    """`state` with the key third of every attention `in_proj_bias` left out. Softmax ignores a
    constant added to all of a query's scores, and a key bias adds q . b_k to each of them, so its
    gradient is zero but for rounding; Adam scales that noise up to lr-sized steps, so its values
    after training depend on the CPU's kernels (AVX2 against AVX-512: up to 8e-4 apart, while every
    other parameter agrees to 1e-8)."""
    if isinstance(state, dict):
        return {k: (torch.cat([v[: len(v) // 3], v[2 * len(v) // 3:]]) if str(k).endswith("in_proj_bias")
                    else without_key_biases(v)) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(without_key_biases(v) for v in state)
    return state


def as_today(state):
    """An old state as today's code writes it: a codebook's config (its own, or a transcoder's
    `vq`) names the distance it sampled over, which older code did not record (Euclidean)."""
    if isinstance(state, dict):
        out = type(state)((k, as_today(v)) for k, v in state.items())  # an OrderedDict stays one
        config = out.get("config")
        if isinstance(config, dict) and "n_codes" in config and "top_k" in config and "distance" not in config:
            out["config"] = {**config, "distance": "euclidean"}
        return out
    if isinstance(state, (list, tuple)):
        return type(state)(as_today(v) for v in state)
    return state


def assert_close_state(got, want, path="state"):
    """`assert_same_state` up to float rounding (RNG states and integers still exact)."""
    assert type(got) is type(want), path
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        if want.is_floating_point():
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=path)
        else:
            assert torch.equal(got, want), path
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for key in want:
            assert_close_state(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want)):
            assert_close_state(a, b, f"{path}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-6, nan_ok=True), path
    else:
        assert got == want, path


@pytest.mark.parametrize("case", CASES)
def test_an_old_checkpoint_loads_exactly_and_resumes_to_its_result(case):
    saved = torch.load(V1 / f"{case}.pt", weights_only=True)
    extractor = make(case)
    extractor.load_state_dict(saved["state"])
    assert_same_state(extractor.state_dict(), as_today(saved["state"]))  # the layout, and every value, unchanged
    got = written(feed(extractor, stream(case)[CUT:]))
    want = as_today(saved["after"])
    assert_close_state(without_key_biases({k: got[k] for k in ("directions", "encoder", "state")}),
                       without_key_biases({k: want[k] for k in ("directions", "encoder", "state")}))
    assert got["stats"] == pytest.approx(want["stats"], rel=1e-4, abs=1e-6, nan_ok=True)


@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("sharded")])
def test_replicas_of_an_old_checkpoint_merge_as_the_old_code_merged_them(case):
    saved = torch.load(V1 / f"{case}.pt", weights_only=True)
    assert_close_state(without_key_biases(merged(case, saved["state"])), without_key_biases(as_today(saved["merged"])))


def test_an_old_fit_checkpoint_resumes():
    run = fit_state({case: make(case) for case in FIT})
    rest = run.resume(V1 / "fit_checkpoint.pt", iter(TEXTS))
    assert list(rest) == TEXTS[CUT:] and run.documents == CUT
    for case in FIT:
        want = torch.load(V1 / f"{case}.pt", weights_only=True)["state"]
        assert_same_state(run.extractors[case].state_dict(), as_today(want))


def test_an_old_concept_set_loads_exactly():
    cs = ConceptSet.load(V1 / "vq_set")
    after = torch.load(V1 / "vq.pt", weights_only=True)["after"]
    assert cs.method == "vq" and torch.equal(cs.directions, after["directions"])
    assert torch.equal(cs.encoder["codebook"], after["encoder"]["codebook"])


@pytest.mark.parametrize("case", ["vq", "vq_plain", "sharded_vq"])
def test_an_old_codebook_is_refused_by_one_that_samples_otherwise_and_read_as_it_sampled(case):
    """Codebooks saved before `VQConfig.distance` sampled over Euclidean distances: today's default
    (squared, as the CLVQ-VAE code) refuses their state in one line; `from_state` reads it as it was."""
    from conceptlens.concepts import vq, vq_sharded

    saved = torch.load(V1 / f"{case}.pt", weights_only=True)
    name, kwargs, _ = CASES[case]
    fresh = getattr(vq_sharded if name == "ShardedVQ" else vq, name)(seed=0, **kwargs)
    with pytest.raises(ValueError, match=r"different config: \[\('distance', 'euclidean', 'squared'\)\]"):
        fresh.load_state_dict(saved["state"])
    assert type(fresh).from_state(saved["state"]).config.distance == "euclidean"


def test_an_old_transcoder_resumes_sampling_as_it_did_and_a_new_one_over_squared_distances():
    saved = torch.load(V1 / "clvq_mlp.pt", weights_only=True)
    tc = make("clvq_mlp")
    assert tc.vq.config.distance == "squared"  # today's default
    tc.load_state_dict(saved["state"])
    assert tc.vq.config.distance == "euclidean"  # as the state was fitted (its codebook config names none)
    again = make("clvq_mlp")
    again.load_state_dict(tc.state_dict())
    assert again.vq.config.distance == "euclidean" and tc.state_dict()["vq"]["config"]["distance"] == "euclidean"
