"""Fitting across processes: gloo ranks spawned in-process, every run bounded by a timeout."""

from __future__ import annotations

import pytest
import torch

from conceptlens.concepts import TopKSAE
from conceptlens.distributed import Comm, DistributedError
from tests import distributed_workers as W
from tests.conftest import assert_same_state, tiny_model

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is unavailable")


def _ok(codes, results):
    assert codes == [0] * len(codes), results
    return results


def test_step_statistics_are_all_reduced_so_two_ranks_equal_one_process(tmp_path):
    """k-means and VQ: 2 ranks fed uneven parts (some empty) of each global batch give the
    state of 1 process fed the global batches; SAE: per-rank batch B equals one process with 2B."""
    codes, results, _ = W.spawn(W.exact_body, 2, tmp_path)
    r0, r1 = _ok(codes, results)
    for name, make in W.EXACT.items():
        alone = make()
        for x, _cut in W.global_batches():
            alone.update(x)
        alone.flush()
        mine, ref = r0[name], alone.state_dict()
        key = "centres" if name.startswith("kmeans") else "fitted"
        a, b = (mine[key], ref[key]) if key == "centres" else (mine[key]["codes"], ref[key]["codes"])
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert_same_state(r0[name][key], r1[name][key])  # the ranks agree bit for bit
        assert mine["steps"] == ref["steps"]
        if "n_seen" in mine:  # k-means: every rank's rows, as one process counts them
            assert r0[name]["n_seen"] == r1[name]["n_seen"] == ref["n_seen"]
    ref_sae = W.sae_for_ddp(batch_size=64)  # one process, batch = both ranks' rows
    for x in W.sae_batches():
        ref_sae.update(x)
    assert r0["sae_steps"] == ref_sae.stats().steps == len(W.sae_batches())  # one step per update
    for name, p in ref_sae.params.items():
        torch.testing.assert_close(r0["sae"][name], p.detach(), rtol=1e-4, atol=1e-5)
        assert torch.equal(r0["sae"][name], r1["sae"][name])
    ref_sae = W.sae_for_ddp(batch_size=64, dtype="bfloat16")  # bf16 compute: each rank's half-batch
    for x in W.sae_batches():                                   # gradient is rounded apart, so close,
        ref_sae.update(x)                                       # not equal, to one process
    for name, p in ref_sae.params.items():
        assert p.dtype == r0["sae_bf16"][name].dtype == torch.float32
        torch.testing.assert_close(r0["sae_bf16"][name], p.detach(), rtol=1e-2, atol=2e-3)
        assert torch.equal(r0["sae_bf16"][name], r1["sae_bf16"][name])


def test_a_jumprelu_sae_steps_alike_on_ranks_through_its_sparse_step(tmp_path):
    """The DDP step decodes and counts a JumpReLU code from its active and near-threshold entries, as
    the single-process step does, with no dense (B, width) code; the thresholds learn as through the
    dense step, and the ranks agree bit for bit."""
    params = []
    for sparse in (True, False):
        codes, results, _ = W.spawn(W.jumprelu_body, 2, tmp_path / str(sparse), sparse)
        r0, r1 = _ok(codes, results)
        assert r0["dense_fills"] == r1["dense_fills"] == 0
        r0, r1 = r0["params"], r1["params"]
        for name in r0:
            assert torch.equal(r0[name], r1[name])
        params.append(r0)
    assert not torch.equal(params[0]["log_threshold"], params[0]["log_threshold"][0].expand(16))  # thresholds moved apart
    for name, value in params[0].items():
        torch.testing.assert_close(value, params[1][name], rtol=1e-4, atol=1e-5)


def test_an_hsae_keeps_its_decoders_unit_and_alike_on_a_rank_that_steps_without_rows(tmp_path):
    """H-SAE renormalises W_top and D_child after every Adam step: also on a rank that had no rows for
    that step, or the ranks' parameters drift apart."""
    codes, results, _ = W.spawn(W.hsae_body, 2, tmp_path)
    r0, r1 = _ok(codes, results)
    for name in r0:
        assert torch.equal(r0[name], r1[name]), name
    torch.testing.assert_close(r1["W_top"].norm(dim=-1), torch.ones(6))
    torch.testing.assert_close(r1["D_child"].norm(dim=1), torch.ones_like(r1["D_child"].norm(dim=1)))


def test_the_step_statistics_of_ranks_whose_rows_differ_in_mean_are_those_of_one_process(tmp_path):
    """FVU's denominator is the spread of every rank's rows about their common mean, as one process
    with the global batch has it, not the sum of each rank's spread about its own mean."""
    codes, results, _ = W.spawn(W.stats_body, 2, tmp_path)
    r0, r1 = _ok(codes, results)
    assert r0["stats"] == r1["stats"]
    alone = W.sae_for_ddp(batch_size=64)
    for x in W.sae_batches():
        alone.update(torch.cat(W.shifted_halves(x)))
    ref = alone.stats()
    assert r0["stats"][:2] == (ref.steps, ref.tokens)
    for got, want in ((r0["stats"][2], ref.last), (r0["stats"][3], ref.mean)):
        assert got.fvu > 0.05
        assert tuple(got) == pytest.approx(tuple(want), rel=1e-4, abs=1e-6)


def _planted(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dirs = 4 * torch.nn.functional.normalize(torch.randn(6, 10, generator=torch.Generator().manual_seed(0)), dim=1)
    return (torch.rand(n, 6, generator=g) < 0.15).float() @ dirs + 0.2 * torch.randn(n, 10, generator=g)


def test_mixing_extractors_reach_the_same_quality_on_uneven_shards(tmp_path):
    """Deleuzian pairs within each rank's blocks and the SAE mixes within each rank's buffer,
    so 2 ranks cannot equal 1 process exactly; they must reach the same quality. One
    process's held-out Deleuzian inertia and SAE FVU vary by more than 1% between seeds, so
    the 2-rank values must lie within the spread of 3 single-process seeds, widened by 1%
    (inertia) or 0.01 (FVU)."""
    data = _planted(24000, 1)
    shards = [data[:14000], data[14000:]]  # rank 0 has more batches than rank 1
    codes, results, _ = W.spawn(W.quality_body, 2, tmp_path, shards)
    r0, r1 = _ok(codes, results)
    assert_same_state(_tensors(r0["sae"]), _tensors(r1["sae"]))
    assert torch.equal(r0["deleuzian"]["kmeans"]["centres"], r1["deleuzian"]["kmeans"]["centres"])
    held = _planted(3000, 2)
    inertia, fvu = [], []
    for seed in (4, 5, 6):
        dz, sae = W.quality_extractors(ranks=1, seed=seed)  # SAE: one process with the global batch
        for x in data.split(100):
            sae.update(x)
            dz.update(x)
        sae.flush()
        dz.flush()
        inertia.append(_pair_inertia(dz, held))
        fvu.append(_fvu(sae, held))
    two_dz, two_sae = W.quality_extractors()
    two_dz.load_state_dict(r0["deleuzian"])
    two_sae.load_state_dict(r0["sae"])
    two_inertia, two_fvu = _pair_inertia(two_dz, held), _fvu(two_sae, held)
    assert 0.99 * min(inertia) <= two_inertia <= 1.01 * max(inertia), (two_inertia, inertia)
    assert min(fvu) - 0.01 <= two_fvu <= max(fvu) + 0.01, (two_fvu, fvu)


def _pair_inertia(dz, x: torch.Tensor) -> float:
    """k-means inertia of held-out oriented differences against the concepts (the objective Deleuzian fits)."""
    diff = x[1:] - x[:-1]
    return dz._fitted().inertia(diff * torch.sign((diff @ dz.centroids.T).max(1).values)[:, None])


def _fvu(sae: TopKSAE, x: torch.Tensor) -> float:
    err = (sae.reconstruct(x) - x).pow(2).sum()
    return float(err / (x - x.mean(0)).pow(2).sum())


def test_fit_shards_documents_and_ranks_agree(tmp_path):
    """41 documents on 2 ranks: rank 0 has 6 batches of 4, rank 1 has 5; the fit ends on both,
    the ranks hold the same extractors, the q/k moments equal those of one process. Each
    extractor is updated on one rank only (the k-means on rank 1), and the checkpoint stores
    each extractor's state once."""
    codes, results, _ = W.spawn(W.fit_body, 2, tmp_path / "out", str(tmp_path / "run"))
    r0, r1 = _ok(codes, results)
    assert (r0["documents"], r1["documents"]) == (21, 20) and r0["batches"] == r1["batches"] == 6
    assert (r0["kmeans_updates"], r1["kmeans_updates"]) == (0, 6)
    assert r0["tokens"] == r1["tokens"] == sum(min(len(d), 24) for d in W.CORPUS)
    for key in r0["states"]:
        if "KillSwitch" in key or "resid" in key:
            assert torch.equal(r0["states"][key]["centres"], r1["states"][key]["centres"])
    sae0, sae1 = (r["states"]["blocks.0.mlp_out"] for r in (r0, r1))
    assert_same_state(_tensors(sae0), _tensors(sae1))
    assert_same_state(sae0["_extra_state"]["optimizer"], sae1["_extra_state"]["optimizer"])
    moments = r0["states"][str(("blocks.1.attn.q", "blocks.1.attn.k"))]
    single = _single_process_moments()
    for name in ("sum_qq", "sum_kk", "sum_q", "sum_k"):
        torch.testing.assert_close(moments[name], single[name], rtol=1e-10, atol=1e-9)
    assert (moments["n_q"], moments["n_k"]) == (single["n_q"], single["n_k"])
    run = tmp_path / "run"
    assert (run / "checkpoint.pt").is_file() and (run / "concepts").is_dir()
    saved = torch.load(run / "checkpoint.pt", weights_only=True)["state"]
    assert saved["world_size"] == 2 and len(saved["ranks"]) == 2
    for name, state in saved["ranks"][1]["extractors"].items():  # the same on both ranks: stored once
        assert _storages(state) == _storages(saved["ranks"][0]["extractors"][name]) != [], name
    codes, results, _ = W.spawn(W.fit_body, 1, tmp_path / "one", str(run))  # resumed on 1 process: refused
    assert codes == [1] and results[0].splitlines()[0] == (
        f"ValueError: checkpoint {run / 'checkpoint.pt'} was written by a fit on 2 process(es); this fit runs on 1: "
        "resume with the same world size, or use resume=False")


def _storages(state) -> list[int]:
    """Where the tensors of a nested state keep their data."""
    if isinstance(state, torch.Tensor):
        return [state.untyped_storage().data_ptr()] if state.numel() else []
    if isinstance(state, dict):
        return [p for v in state.values() for p in _storages(v)]
    return [p for v in state for p in _storages(v)] if isinstance(state, (list, tuple)) else []


def _single_process_moments() -> dict:
    import conceptlens
    from conceptlens.filters import FilterConfig
    from conceptlens.metrics.gauge import QueryKeyMoments
    from tests.conftest import CharTokenizer, tiny_model

    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    moments = QueryKeyMoments()
    lens.fit({("blocks.1.attn.q", "blocks.1.attn.k"): moments}, W.CORPUS, batch_size=4, max_length=24,
             progress=False, filters=FilterConfig(max_norm_ratio=None))
    return moments.state_dict()


def test_a_dead_rank_stops_the_others_with_a_clear_error_and_both_resume_bit_identical(tmp_path):
    whole_codes, whole, _ = W.spawn(W.fit_body, 2, tmp_path / "whole", str(tmp_path / "run_whole"))
    _ok(whole_codes, whole)
    # rank 1 is SIGKILLed inside its 5th k-means update (of 6), after two checkpoints
    codes, results, seconds = W.spawn(W.fit_body, 2, tmp_path / "killed", str(tmp_path / "run"), {1: 5},
                                      collective_timeout=20.0)
    assert codes[1] == -9 and codes[0] == 1, results
    message = results[0].splitlines()[0]  # the error itself is one line, naming the rank that died
    assert message.startswith("DistributedError: rank 0/2: ") and "rank 1 died or stopped answering" in message
    assert seconds < 120  # the survivor gave up instead of hanging
    assert (tmp_path / "run" / "checkpoint.pt").is_file()
    codes, resumed, _ = W.spawn(W.fit_body, 2, tmp_path / "resumed", str(tmp_path / "run"))
    _ok(codes, resumed)
    for rank in (0, 1):
        a, b = whole[rank], resumed[rank]
        assert b["resumed_from"] > 0 and a["tokens"] == b["tokens"]
        for key in a["states"]:
            assert_same_state(a["states"][key], b["states"][key])


def test_ranks_that_resume_at_different_points_stop_at_once_naming_where(tmp_path):
    """Ranks that do not share the run folder: rank 0 resumes a checkpoint, rank 1 finds none and starts
    afresh. They stepped together on other documents until the collectives of the next checkpoint
    failed after the full timeout, naming no cause."""
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir(), node1.mkdir()
    _ok(*W.spawn(W.own_folder_body, 2, tmp_path / "first", [str(node0), str(node0)])[:2])
    assert (node0 / "run" / "checkpoint.pt").is_file()
    codes, results, seconds = W.spawn(W.own_folder_body, 2, tmp_path / "split", [str(node0), str(node1)],
                                      collective_timeout=60.0)
    assert codes == [1, 1], results
    for rank, text in enumerate(results):
        line = text.splitlines()[0]
        assert line.startswith(f"DistributedError: rank {rank}/2: the ranks resumed at different points (rank 0 at ")
        assert "rank 1 at 0 tokens" in line and "a file system they share" in line
    assert seconds < 50  # at once, not after the collective timeout


def test_fit_distributed_without_a_process_group_names_the_fix():
    with pytest.raises(DistributedError, match="torchrun"):
        Comm()


def test_torchrun_starts_a_distributed_fit_from_its_environment(tmp_path):
    """torchrun, 2 ranks of batch 4: the ranks agree, and every extractor (k-means, a TopK SAE, a
    transcoder on a pair key, a crosscoder on two sites) equals one process with batch 8."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests import torchrun_fit
    from tests.test_distributed_equal import assert_close_state

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(W.free_port()), str(root / "tests" / "torchrun_fit.py"), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CONCEPTLENS_DIST_TIMEOUT": "60"}
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert r0["tokens"] == r1["tokens"] == sum(min(len(d), 24) for d in W.CORPUS)
    assert (r0["documents"], r1["documents"]) == (21, 20)
    assert_same_state(_tensors(r0["states"]["blocks.0.mlp_out"]), _tensors(r1["states"]["blocks.0.mlp_out"]))
    assert torch.equal(r0["states"]["blocks.1.resid_out"]["centres"], r1["states"]["blocks.1.resid_out"]["centres"])
    alone, report = torchrun_fit.fit(8, False)  # one process with the global batch; multi-site keys too
    assert r0["tokens"] == report.tokens and any(isinstance(key, tuple) for key in alone)
    for key, extractor in alone.items():
        for rank in (r0, r1):
            assert_close_state(rank["states"][key], extractor.state_dict(), str(key))


def test_shutdown_destroys_only_the_group_init_created(monkeypatch):
    import torch.distributed as dist

    from conceptlens import distributed
    from tests.distributed_workers import free_port

    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    distributed.init(timeout_s=30)
    assert dist.is_initialized()
    distributed.shutdown()  # init created it: destroyed, so the process can exit cleanly
    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        distributed.init(timeout_s=30)  # reuses the caller's group
        distributed.shutdown()
        assert dist.is_initialized()  # the caller's group is the caller's to destroy
    finally:
        dist.destroy_process_group()


def test_each_extractor_not_sharded_is_updated_on_one_rank_rank_0_last():
    """The i-th movable extractor by name goes to rank W - 1 - i % W; a sharded one, and one whose
    state cannot travel, run on every rank (None)."""
    from conceptlens.distributed_placement import owners

    class Sharded(TopKSAE):
        shards = None  # stands for a Shards split

    class Stateless:
        def update(self, x):
            pass

    fitted = {name: TopKSAE(width=4, k=1) for name in ("e", "a", "c", "b", "d")}
    fitted |= {"s": Sharded(width=4, k=1), "t": Stateless()}
    assert owners(fitted, 2) == {"a": 1, "b": 0, "c": 1, "d": 0, "e": 1, "s": None, "t": None}
    assert owners(fitted, 3) == {"a": 2, "b": 1, "c": 0, "d": 2, "e": 1, "s": None, "t": None}
    assert set(owners(fitted, 1).values()) == {0, None}


def test_a_checkpoint_stores_the_owners_states_shared():
    """Rank 0 completes every rank's entry with the owner's state (the same objects) and keeps each
    rank's own state of a sharded extractor."""
    from conceptlens.distributed_placement import fill_ranks

    sent = [{"rows": 0, "extractors": {"a": {"w": torch.zeros(2)}, "s": {"w": torch.zeros(1)}}},
            {"rows": 1, "extractors": {"b": {"w": torch.ones(2)}, "s": {"w": torch.ones(1)}}}]
    ranks = fill_ranks(sent, {"a": 0, "b": 1, "s": None})
    assert [r["rows"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["extractors"]["a"] is sent[0]["extractors"]["a"] and r["extractors"]["b"] is sent[1]["extractors"]["b"]
    assert [r["extractors"]["s"]["w"].tolist() for r in ranks] == [[0.0], [1.0]]


def _tensors(sae_state):
    """An SAE state's parameters and buffers (its module tensors, without the training state)."""
    return {k: v for k, v in sae_state.items() if k != "_extra_state"}


def test_a_run_folder_fitted_and_described_under_torchrun_equals_one_process_with_the_global_batch(tmp_path):
    """`conceptlens fit` on 2 ranks of batch 4 against one process of batch 8: fit_report.json counts every
    rank's documents (it held rank 0's), and the description pass reads the same documents with the same
    batch (rank 0 described with its own batch of 4: other documents, other statistics)."""
    import json
    import os
    import random
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from conceptlens.cli import main
    from tests.steering.test_sweep import word_tokenizer

    model, tok = tiny_model("llama"), word_tokenizer()
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    rng = random.Random(0)
    lines = [" ".join(f"w{rng.randrange(3, 99)}" for _ in range(rng.randrange(3, 14))) for _ in range(90)]
    (tmp_path / "docs.txt").write_text("\n".join(lines) + "\n")

    def args(out: Path, batch: int) -> list[str]:
        return ["fit", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "docs.txt"), "--out", str(out),
                "--site", "blocks.1.resid_out", "--extractor", "kmeans:n_concepts=4,init_size=64,name=km",
                "--batch-size", str(batch), "--max-length", "16", "--max-tokens", "300", "--describe-tokens", "300",
                "--top-n", "3", "--window", "2,1", "--no-progress"]

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(W.free_port()), "-m", "conceptlens.cli", *args(tmp_path / "ranks", 4)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CONCEPTLENS_DIST_TIMEOUT": "60", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with W.one_thread():  # as the ranks ran (OMP_NUM_THREADS=1): the same kernels, so statistics compare exactly
        assert main(args(tmp_path / "alone", 8)) == 0
    reports = [json.loads((tmp_path / run / "fit_report.json").read_text()) for run in ("ranks", "alone")]
    assert reports[0]["documents"] == reports[1]["documents"] and reports[0]["tokens"] == reports[1]["tokens"]
    infos = [json.loads((tmp_path / run / "describe" / "km" / "description.json").read_text())
             for run in ("ranks", "alone")]
    assert [(i["first_document"], i["documents"], i["tokens"]) for i in infos[:1]] == \
        [(i["first_document"], i["documents"], i["tokens"]) for i in infos[1:]]
    stats = [load_file(tmp_path / run / "describe" / "km" / "stats.safetensors") for run in ("ranks", "alone")]
    for key in ("hist_counts", "top_doc", "top_pos", "frequency"):
        assert torch.equal(stats[0][key], stats[1][key]), key
    # run.toml records that batch, so describing the folder again reads what the fit's own pass read
    assert "[describe]" in (toml := (tmp_path / "ranks" / "run.toml").read_text()) and "batch_size = 8" in toml
    with W.one_thread():
        assert main(["describe", str(tmp_path / "ranks"), "--no-resume"]) == 0
    again = load_file(tmp_path / "ranks" / "describe" / "km" / "stats.safetensors")
    for key in ("hist_counts", "top_doc", "top_pos", "frequency"):
        assert torch.equal(again[key], stats[1][key]), key
