"""Dictionaries sharded across processes equal the unsharded ones: gloo ranks spawned in-process."""

from __future__ import annotations

import pytest
import torch

from conceptlens.concepts import TopKSAE
from tests import distributed_workers as W
from tests import sharded_workers as S
from tests.test_distributed_equal import assert_close_state

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is unavailable")


def _alone() -> dict:
    km, ae, books = S.kmeans(False), S.sae(False), S.vqs(False)
    S.feed(km, ae, codebooks=books)
    return S.outcome(km, ae, books)


@pytest.mark.parametrize("resume_at", [None, 1, 5])  # 1: before k-means and VQ initialise
def test_two_shards_equal_one_unsharded_dictionary(tmp_path, resume_at):
    """k-means (15 centres: shards of 8 and 7, with reseeding), a TopK SAE (41 latents, AuxK
    on dead latents) and VQ codebooks (15 codes; k-means, spherical and random initialisation,
    sampling among more nearest codes than a shard holds, a mixing buffer, dead codes reseeded):
    each rank holds its slice, and the gathered dictionary, the statistics and the encodings
    equal one unsharded process's, also after a resume from each rank's state."""
    codes, results, _ = W.spawn(S.sharded_body, 2, tmp_path, resume_at)
    assert codes == [0, 0], results
    alone = _alone()
    assert alone["reseeded"] > 0 and alone["stats"].last.dead_fraction > 0  # reseeding and AuxK were exercised
    assert [r["shard_rows"] for r in results] == [(8, 21, 8), (7, 20, 7)]
    for r in results:
        shards = r.pop("shard_rows"), r.pop("dead_steps")
        assert shards
        assert_close_state(dict(r), dict(alone))


@pytest.mark.parametrize("width, d", [(4000, 16), (1001, 3)])
def test_each_rank_draws_only_its_slice_of_the_initial_sae(tmp_path, width, d):
    """A ShardedTopKSAE on 2 ranks builds only its latents: W_enc, b_enc and W_dec are 1/2 of one
    process's, no tensor made while drawing them holds more than half the decoder (plus one block
    of 16 rows), the values are one unsharded TopKSAE's rows bit for bit and the generator ends
    in the same state."""
    codes, results, _ = W.spawn(S.init_body, 2, tmp_path, width, d)
    assert codes == [0, 0], results
    alone = TopKSAE(width=width, k=4, seed=7)
    whole = alone._init_params(torch.randn(64, d, generator=torch.Generator().manual_seed(1)))
    after = torch.rand(4, generator=alone.trainer.generator)
    assert [r["slice"] for r in results] == [(0, (width + 1) // 2), ((width + 1) // 2, width)]
    for r in results:
        (lo, hi), p = r["slice"], r["params"]
        assert p["W_dec"].shape == (hi - lo, d) and p["W_enc"].shape == (d, hi - lo) and p["b_enc"].shape == (hi - lo,)
        assert r["largest"] <= (hi - lo + 16) * d < width * d
        assert torch.equal(p["W_dec"], whole["W_dec"][lo:hi]) and torch.equal(p["W_enc"], whole["W_enc"][:, lo:hi])
        assert torch.equal(p["b_enc"], whole["b_enc"][lo:hi]) and torch.equal(p["b_dec"], whole["b_dec"])
        assert torch.equal(r["after"], after)


def test_sharded_sae_step_takes_three_collectives_and_equals_one_process(tmp_path):
    """3 ranks (41 latents: shards of 14, 14 and 13): every step, AuxK or not, is one all-gather of
    the top-k candidates, one all-reduce of the partial reconstructions and firing counts and one
    of b_dec's gradient; the SAE equals one unsharded process's."""
    codes, results, _ = W.spawn(S.traffic_body, 3, tmp_path)
    assert codes == [0, 0, 0], results
    alone = S.sae(False)
    for x in W.sae_batches():
        alone.update(x)
    for r in results:
        assert r["steps"] == alone.stats().steps and 0 < r["aux_steps"] < r["steps"]
        assert r["collectives"] == 3 * r["steps"]
        assert_close_state(r["outcome"], S.sae_outcome(alone))


@pytest.mark.parametrize("n, d", [(41, 3), (1000, 7), (17, 1), (5, 3), (100, 33)])
def test_randn_rows_is_a_slice_of_one_draw(n, d):
    """`randn_rows` gives rows [lo, hi) of one `torch.randn(n, d)` draw bit for bit and leaves the
    generator where that draw leaves it (sizes under, at and over torch's 16-number blocks)."""
    from conceptlens.concepts.sharded import randn_rows

    g = torch.Generator().manual_seed(5)
    whole, after = torch.randn(n, d, generator=g), torch.rand(3, generator=g)
    for lo, hi in [(0, n // 2), (n // 2, n), (1, n - 1), (0, n)]:
        g = torch.Generator().manual_seed(5)
        assert torch.equal(randn_rows(n, d, lo, hi, g), whole[lo:hi])
        assert torch.equal(torch.rand(3, generator=g), after)


def test_one_process_sharded_is_unsharded():
    """Without a process group a sharded extractor is the unsharded one, bit for bit."""
    km, ae, books = S.kmeans(True), S.sae(True), S.vqs(True)
    S.feed(km, ae, codebooks=books)
    mine, alone = S.outcome(km, ae, books), _alone()
    for key in ("centres", "directions"):
        torch.testing.assert_close(mine[key], alone[key], rtol=1e-6, atol=1e-7)
    for name in S.VQ:
        torch.testing.assert_close(mine[name]["codes"], alone[name]["codes"], rtol=1e-6, atol=1e-7)


def _torchrun(script: str, *args) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(W.free_port()), str(root / "tests" / script), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CONCEPTLENS_DIST_TIMEOUT": "60"}
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_sharded_fit_under_torchrun_resumes_and_equals_one_unsharded_process(tmp_path):
    """torchrun, 2 ranks of batch 4, sharded k-means, TopK SAE and VQ, stopped half-way (each rank's
    shard in the checkpoint) and resumed: the concept sets equal one unsharded process with batch 8."""
    from tests import torchrun_sharded_fit

    total = sum(min(len(d), 24) for d in W.CORPUS)
    _torchrun("torchrun_sharded_fit.py", tmp_path, total // 2)
    first = torch.load(tmp_path / "rank0.pt", weights_only=True)
    _torchrun("torchrun_sharded_fit.py", tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert 0 < first["tokens"] < total and ranks[0]["resumed_from"] == first["tokens"]
    assert [r["rows"] for r in ranks] == [(2, 8, 3), (2, 8, 3)]  # 4 centres, 16 latents, 6 codes: half on each rank
    report = torchrun_sharded_fit.fit_alone(8)
    assert ranks[0]["tokens"] == report.tokens
    for name, cs in report.concepts.items():
        for rank in ranks:
            assert_close_state(rank["concepts"][name], {"directions": cs.directions, "encoder": cs.encoder}, name)


def test_the_live_fraction_counts_every_shards_centres(tmp_path):
    alone = S.two_points(False)
    assert 0 < alone.stats().live_fraction < 1  # some centres hold no mass
    codes, results, _ = W.spawn(S.live_body, 2, tmp_path)
    assert codes == [0, 0], results
    for r in results:  # each rank's report is one process's (it read its own shard's centres before)
        assert torch.equal(r["mass"], alone.mass) and r["stats"] == alone.stats()
