"""A distributed fit equals one process with the global batch: gloo ranks spawned in-process
(tests/distributed_fit_workers.py) and torchrun as two simulated nodes."""

from __future__ import annotations

import pytest
import torch

from tests import distributed_fit_workers as F
from tests import distributed_workers as W
from tests.conftest import assert_same_state

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is unavailable")


def _ok(codes, results):
    assert codes == [0] * len(codes), results
    return results


def assert_close_state(a, b, path: str = "state") -> None:
    """Nested states equal to float tolerance (rtol 1e-5); integers, flags and RNG states exactly."""
    if isinstance(a, torch.Tensor) and a.is_floating_point():
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{path}: {m}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_close_state(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close_state(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6) or (a != a and b != b), path
    else:
        assert a == b, path


def test_two_ranks_with_batch_b_equal_one_process_with_batch_2b(tmp_path):
    """41 documents (uneven shards; in one step rank 1 has only empty ones) through k-means,
    Deleuzian (streaming and paper), TopK SAE, VQ, q/k moments, a CLVQ transcoder and a
    token-aware statistic, with mixing buffers on and a row filter tight enough to drop rows:
    every state, and the filter's counts, equal one process's (the token-aware one sees the
    same documents, positions and ids)."""
    corpus = ["" if i in (9, 11, 13, 15) else doc for i, doc in enumerate(W.CORPUS)]  # rank 1: nothing in step 2
    codes, results, _ = W.spawn(F.equal_body, 2, tmp_path, None, corpus)
    r0, r1 = _ok(codes, results)
    alone = F.equal_fit(8, False, corpus=corpus)
    assert r0["tokens"] == r1["tokens"] == alone["tokens"]
    assert r0["rows"] == r1["rows"] == alone["rows"]
    assert 0 < alone["rows"]["blocks.1.resid_out"]["norm_outlier"]  # the filter's median mattered
    assert alone["states"]["tokens"]["doc"].max() == len(W.CORPUS) - 1  # rows know their document in the corpus
    for name, state in alone["states"].items():
        assert_same_state(r0["states"][name], r1["states"][name], name)  # the ranks agree bit for bit
        assert_close_state(r0["states"][name], state, name)


def test_ranks_pad_to_the_steps_widest_batch_so_a_thresholded_sae_equals_one_process(tmp_path):
    """Each rank padded its batch to its own longest document; the forward's rows then differed from one
    process's by rounding (7e-9), and JumpReLU's threshold turned that into other codes (W_enc off by 0.03)."""
    codes, results, _ = W.spawn(F.padded_body, 2, tmp_path)
    r0, r1 = _ok(codes, results)
    with W.one_thread():  # the ranks' kernels: the test is of padding, not of how thread counts round
        alone = F.padded_fit(8, False)
    assert r0["tokens"] == r1["tokens"] == alone["tokens"]
    for name, state in alone["states"].items():
        assert_same_state(r0["states"][name], r1["states"][name], name)
        assert_close_state(r0["states"][name], state, name)


def test_extractors_with_their_own_budgets_stop_at_one_global_count_on_every_rank(tmp_path):
    """Per-extractor budgets (`FitConfig.extractor_tokens`) count the global step's tokens: two ranks
    stop the SAE, the k-means and the VQ codebook (each updated on the rank that owns it) where one
    process with the global batch does, and the others go on to the end. The token log and the
    cross-layer transcoder are the only readers of three sites: once both budgets are spent, every
    rank captures those no more."""
    clt = "blocks.0.mlp.in+blocks.1.mlp.in->blocks.0.mlp_out+blocks.1.mlp_out"
    budgets = {"topk": 300, "km": 700, "vq": 500, "tokens": 400, clt: 400}
    codes, results, _ = W.spawn(F.equal_body, 2, tmp_path, None, W.CORPUS, None, budgets)
    r0, r1 = _ok(codes, results)
    alone = F.equal_fit(8, False, extractor_tokens=budgets)
    whole = F.equal_fit(8, False)
    assert r0["tokens"] == r1["tokens"] == alone["tokens"] == whole["tokens"]
    for name, state in alone["states"].items():
        assert_same_state(r0["states"][name], r1["states"][name], name)
        assert_close_state(r0["states"][name], state, name)
    assert alone["states"]["km"]["n_seen"] < whole["states"]["km"]["n_seen"]  # the budget stopped it
    assert r0["rows"] == r1["rows"] == alone["rows"]
    for site in ("blocks.0.mlp.in", "blocks.1.mlp.in", "blocks.0.mlp_out"):  # counted up to the budgets only
        assert 400 <= alone["rows"][site]["seen"] < whole["rows"][site]["seen"] == whole["tokens"]
    assert alone["rows"]["blocks.1.mlp_out"] == whole["rows"]["blocks.1.mlp_out"]  # the crosscoder reads on


def test_each_rank_receives_and_filters_only_the_sites_it_updates(tmp_path):
    """Two k-means at two sites, each updated on one rank: a rank receives and filters the rows
    of its site only, yet every rank's report and states, and every rank's row-filter state in
    the checkpoint, equal one process's with the global batch."""
    codes, results, _ = W.spawn(F.routed_body, 2, tmp_path, str(tmp_path / "run"))
    r0, r1 = _ok(codes, results)
    assert r0["received"] == r0["filtered"] == ["blocks.1.resid_out"]
    assert r1["received"] == r1["filtered"] == ["blocks.0.resid_out"]
    alone = F.routed_fit(8, False, str(tmp_path / "alone"))
    assert r0["rows"] == r1["rows"] == alone["rows"] and r0["tokens"] == alone["tokens"]
    assert 0 < alone["rows"]["blocks.0.resid_out"]["norm_outlier"]  # the filter's median mattered
    for name, state in alone["states"].items():
        assert_same_state(r0["states"][name], r1["states"][name], name)
        assert_close_state(r0["states"][name], state, name)
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["state"]
    single = torch.load(tmp_path / "alone" / "checkpoint.pt", weights_only=False)["state"]["rows"]
    for rank in saved["ranks"]:
        assert rank["rows"]["counts"] == single["counts"]
        assert_close_state(rank["rows"]["norms"], single["norms"])


def test_two_simulated_nodes_of_two_ranks_equal_one_process(tmp_path):
    """torchrun --nnodes 2 --nproc-per-node 2 (two agents on this machine, static rendezvous at
    node 0, as on two hosts): 4 ranks with batch 2 equal one process with batch 8."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests import torchrun_fit

    root, port = Path(__file__).resolve().parents[1], W.free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CONCEPTLENS_DIST_TIMEOUT": "120"}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                               str(root / "tests" / "torchrun_fit.py"), str(tmp_path), "2"],
                              cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in (0, 1)]
    try:
        outputs = [node.communicate(timeout=400) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outputs]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(4)]
    alone, report = torchrun_fit.fit(8, False)
    assert [r["documents"] for r in ranks] == [11, 10, 10, 10] and ranks[0]["tokens"] == report.tokens
    for key, extractor in alone.items():
        for rank in ranks:
            assert_close_state(rank["states"][key], extractor.state_dict(), key)
