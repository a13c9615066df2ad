"""Ranks that disagree, die or never join: every survivor stops with one line naming the cause."""

from __future__ import annotations

import pytest
import torch

from conceptlens.distributed import DistributedError
from tests import distributed_fit_workers as F
from tests import distributed_workers as W

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is unavailable")


def _ok(codes, results):
    assert codes == [0] * len(codes), results
    return results


def test_ranks_that_run_different_fits_fail_together_naming_what_differs(tmp_path):
    """Rank 1 given other documents, another model of the same architecture, another k, batch
    size or max_tokens: both ranks stop before the first step with the same one-line error."""
    codes, results, _ = W.spawn(F.mismatch_body, 2, tmp_path)
    r0, r1 = _ok(codes, results)
    expected = {"documents": "data (the first global batch): rank 0 has '8 documents, sha256 ",
                "model": "model weights",
                "k": "extractor 'blocks.1.resid_out' n_concepts: rank 0 has 4, rank 1 has 5",
                "batch_size": "option batch_size: rank 0 has 4, rank 1 has 3",
                "max_tokens": "option max_tokens: rank 0 has None, rank 1 has 500"}
    for case, what in expected.items():
        for rank, message in enumerate((r0[case], r1[case])):
            assert message is not None and "\n" not in message, (case, message)
            assert message.startswith(f"rank {rank}/2: the ranks of this distributed fit differ in {what}"), message


def test_a_rank_that_never_joins_gives_one_line_at_the_join_timeout(tmp_path):
    import multiprocessing

    proc = multiprocessing.get_context("spawn").Process(target=F.lonely_body, args=(tmp_path, W.free_port(), 5.0))
    proc.start()
    proc.join(120)
    if proc.is_alive():
        proc.kill()
    message = (tmp_path / "rank0.err").read_text()
    assert proc.exitcode == 1 and "\n" not in message, message
    assert message.startswith("DistributedError: rank 0/2: 1 of 2 processes joined the distributed fit at "
                              "127.0.0.1:"), message
    assert "within 5 s; start every rank (WORLD_SIZE=2) or raise CONCEPTLENS_DIST_TIMEOUT" in message


def test_the_cli_reports_a_distributed_failure_in_one_line(monkeypatch, capsys):
    from conceptlens.cli import main
    from conceptlens.commands import sites

    def fail(args):
        raise DistributedError("rank 0/2: all_gather failed: rank 1 died or stopped answering")

    monkeypatch.setattr(sites, "run", fail)
    assert main(["sites", "--model", "smollm2-135m"]) == 1
    assert capsys.readouterr().err == ("conceptlens sites: error: rank 0/2: all_gather failed: rank 1 died or "
                                       "stopped answering\n")


@pytest.mark.parametrize("who", [0, 1])
def test_the_survivor_of_a_dead_rank_names_it_in_one_line(tmp_path, who):
    """Rank 1 dead: rank 0 finds it unmarked in the rendezvous store. Rank 0 dead (it holds the
    store when torchrun does not): the store is gone with it, and the message says so."""
    codes, results, _ = W.spawn(F.die_body, 2, tmp_path, who, collective_timeout=20.0)
    survivor = 1 - who
    assert codes[who] == 3 and codes[survivor] == 1, results
    message = results[survivor].splitlines()[0]
    gone = "rank 1 died or stopped answering" if who == 1 else "rank 0 (it holds the rendezvous store) is gone"
    assert message.startswith(f"DistributedError: rank {survivor}/2: all_reduce failed: {gone} (timeout 20 s; "), message


def test_a_group_init_created_is_destroyed_at_exit(monkeypatch):
    """A process that exits with a live gloo group can abort in its destructor (SIGABRT after a finished
    fit): `init` registers `shutdown` to run at exit, once, and `shutdown` leaves no group behind."""
    import atexit

    import torch.distributed as dist

    from conceptlens import distributed
    from tests.distributed_workers import free_port

    registered = []
    monkeypatch.setattr(atexit, "register", lambda f: registered.append(f))
    monkeypatch.setattr(atexit, "unregister", lambda f: registered.remove(f) if f in registered else None)
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    assert not dist.is_initialized()
    try:
        distributed.init("gloo")
        distributed.init("gloo")  # reuses the group: nothing more registered
        assert registered == [distributed.shutdown] and dist.is_initialized()
        registered[0]()
        assert not dist.is_initialized()
    finally:  # no group left to the tests after this one, whatever failed
        if dist.is_initialized():
            dist.destroy_process_group()
        distributed._OWNED = False


@pytest.mark.parametrize("leave", [False, True])
def test_quiesce_waits_for_every_rank_and_not_for_a_departed_one(tmp_path, leave):
    """`quiesce`, which `shutdown` runs before it destroys the group: rank 0 passes only once rank 1
    got there (rank 1 marks its arrival first), and a rank that left without quiescing holds the
    others at most for the timeout (20 s here, the spawn's 120 s never reached)."""
    codes, results, _ = W.spawn(F.quiesce_body, 2, tmp_path, leave, timeout=120.0)
    assert codes[0] == 0, results
    assert results[0]["mark_seen"]
