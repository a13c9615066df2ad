"""Bodies run in spawned gloo processes by tests/test_distributed.py (not collected: no test_ prefix).

`spawn(fn, world, out_dir, *args)` starts `world` processes that join one gloo group on
localhost and call `fn(comm, out_dir, *args)`; each writes what it returns to
out_dir/rank{r}.pt, or its error to out_dir/rank{r}.err. The parent waits at most `timeout`
seconds and kills what is left, so no test can hang.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import conceptlens
from conceptlens.concepts import StreamingKMeans, TopKSAE, VQCodebook, Deleuzian
from conceptlens.distributed import Comm, quiesce
from conceptlens.filters import FilterConfig
from conceptlens.metrics.gauge import QueryKeyMoments

CORPUS = [f"document {i}: " + "abcdefghij"[i % 7:] * (1 + i % 5) for i in range(41)]  # odd: uneven shards


@contextmanager
def one_thread():
    """torch on one thread, as every spawned rank runs: a one-process reference then takes the ranks'
    kernels, so a comparison with them does not hang on how another thread count rounds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, out_dir: str, args: tuple, timeout_s: float) -> None:
    os.environ.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), CONCEPTLENS_DIST_TIMEOUT=str(timeout_s))
    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        result = fn(Comm(timeout_s=timeout_s), out, *args)
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        (out / f"rank{rank}.err").write_text(f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        os._exit(1)
    quiesce()  # as the library's shutdown: every rank is here before any tears its connections down
    dist.destroy_process_group()
    # The body's result is on disk and the group is gone. Skip the interpreter's teardown, where a
    # gloo rank that finished can still abort ("terminate called without an active exception",
    # seen in fresh-clone suite runs): the tests check what the body did, not torch's teardown.
    os._exit(0)


def spawn(fn, world: int, out_dir: Path, *args, timeout: float = 240.0, collective_timeout: float = 60.0) -> list:
    """Run fn on `world` gloo ranks; return (exit codes, results or error texts, seconds)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for r in range(world):  # no stale result of an earlier run
        for suffix in (".pt", ".err"):
            (out_dir / f"rank{r}{suffix}").unlink(missing_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, str(out_dir), args, collective_timeout))
             for r in range(world)]
    start = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(1.0, timeout - (time.monotonic() - start)))
    for p in procs:
        if p.is_alive():  # never leave a hung rank behind
            p.kill()
            p.join()
    seconds = time.monotonic() - start
    results = []
    for r in range(world):
        err, res = out_dir / f"rank{r}.err", out_dir / f"rank{r}.pt"
        results.append(err.read_text() if err.exists() else torch.load(res, weights_only=False) if res.exists() else None)
    return [p.exitcode for p in procs], results, seconds


# ---- extractor-level bodies ---------------------------------------------------------------

def global_batches(n_steps: int = 12, d: int = 6, seed: int = 0) -> list[tuple[torch.Tensor, int]]:
    """(global batch, rows that go to rank 0) per step: uneven splits, some with 0 rows on a rank."""
    g = torch.Generator().manual_seed(seed)
    dirs = 3 * torch.randn(5, d, generator=g)
    out = []
    for t in range(n_steps):
        n = 60 + 17 * (t % 4)
        x = (torch.rand(n, 5, generator=g) < 0.3).float() @ dirs + 0.3 * torch.randn(n, d, generator=g)
        cut = [0, n // 3, n, 2 * n // 3][t % 4]
        out.append((x, cut))
    return out


EXACT = {
    "kmeans": lambda: StreamingKMeans(6, init_size=150, reseed_after=0.5, seed=3),
    "kmeans-spherical": lambda: StreamingKMeans(6, spherical=True, init_size=100, seed=1),
    "vq": lambda: VQCodebook(8, init_size=128, top_k=3, temperature=1.0, reseed_after=4, seed=2),
    # bfloat16 compute: per-rank float32 sums, all-reduced, equal one process's
    "kmeans-bf16": lambda: StreamingKMeans(6, init_size=150, reseed_after=0.5, seed=3, dtype="bfloat16"),
    "vq-bf16": lambda: VQCodebook(8, init_size=128, top_k=3, temperature=1.0, reseed_after=4, seed=2,
                                  dtype="bfloat16"),
}


def exact_body(comm: Comm, out: Path) -> dict:
    """Every EXACT extractor fed this rank's part of each global batch; plus DDP SAE steps."""
    results = {}
    batches = global_batches()
    for name, make in EXACT.items():
        ext = make()
        ext.comm = comm
        for x, cut in batches:
            ext.update(x[:cut] if comm.rank == 0 else x[cut:])
        ext.flush()
        results[name] = ext.state_dict()
    sae = sae_for_ddp()
    sae.comm = comm
    for x in sae_batches():
        half = x.shape[0] // 2
        sae.update(x[:half] if comm.rank == 0 else x[half:])
    results["sae"] = {k: v.detach() for k, v in sae.params.items()}
    results["sae_steps"] = sae.stats().steps
    sae = sae_for_ddp(dtype="bfloat16")
    sae.comm = comm
    for x in sae_batches():
        half = x.shape[0] // 2
        sae.update(x[:half] if comm.rank == 0 else x[half:])
    results["sae_bf16"] = {k: v.detach() for k, v in sae.params.items()}
    return results


def sae_for_ddp(batch_size: int = 32, dtype: str = "float32") -> TopKSAE:
    # buffer = batch: each step takes exactly the rows of one update (mixing made deterministic)
    return TopKSAE(width=16, k=4, batch_size=batch_size, buffer_size=batch_size, warmup_tokens=64,
                   b_dec_init="zeros", seed=5, dtype=dtype)


def sae_batches(n: int = 15) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    dirs = torch.randn(12, 8, generator=g)
    return [(torch.rand(64, 12, generator=g) < 0.2).float() @ dirs + 0.1 * torch.randn(64, 8, generator=g)
            for _ in range(n)]


def jumprelu_body(comm: Comm, out: Path, sparse: bool) -> dict:
    """A JumpReLU SAE's DDP steps on halves of `sae_batches`, through its sparse CPU step or the dense one;
    with how many codes given as their active entries were filled to a dense `(B, width)` code."""
    from conceptlens.concepts.sae import JumpReLUSAE, jumprelu

    from conceptlens.concepts.sae.trainable import Code

    jumprelu.sparse_backward = lambda rows: sparse  # this spawned process's own module
    dense_fills = []  # codes given as active entries that something filled to (B, width)
    dense_z = Code.z.fget

    def z(code):
        if code._z is None:
            dense_fills.append(len(code.pre))
        return dense_z(code)

    Code.z = property(z)
    sae = JumpReLUSAE(width=16, batch_size=32, buffer_size=32, warmup_tokens=64, b_dec_init="zeros",
                      bandwidth=0.5, seed=5)
    sae.comm = comm
    for x in sae_batches():
        half = x.shape[0] // 2
        sae.update(x[:half] if comm.rank == 0 else x[half:])
    return {"params": {k: v.detach() for k, v in sae.params.items()}, "dense_fills": len(dense_fills)}


def hsae_body(comm: Comm, out: Path) -> dict:
    """An HSAE's DDP steps where rank 1 has rows for one step of every two (the other is an empty step)."""
    from conceptlens.concepts.sae import HSAE

    sae = HSAE(parents=6, children=3, subspace=4, k=2, batch_size=32, buffer_size=32, warmup_tokens=64, seed=5)
    sae.comm = comm
    for x in sae_batches():
        sae.update(x if comm.rank == 0 else x[:32])
    return {k: v.detach() for k, v in sae.params.items()}


def stats_body(comm: Comm, out: Path) -> dict:
    """A TopK SAE's step statistics when the ranks' rows have different means (`shifted_halves`)."""
    sae = sae_for_ddp()
    sae.comm = comm
    for x in sae_batches():
        sae.update(shifted_halves(x)[comm.rank])
    return {"stats": tuple(sae.stats())}


def shifted_halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = x.shape[0] // 2
    return x[:half] + 2.0, x[half:] - 2.0


def quality_body(comm: Comm, out: Path, shards: list[torch.Tensor]) -> dict:
    """Deleuzian and an SAE with their mixing buffers on, fed this rank's uneven shard."""
    dz, sae = quality_extractors()
    for ext in (dz, sae):
        ext.comm = comm
    mine = shards[comm.rank].split(100)
    longest = max(len(s.split(100)) for s in shards)
    for i in range(longest):  # a rank out of data feeds empty batches, as the fit does
        x = mine[i] if i < len(mine) else shards[comm.rank][:0]
        dz.update(x)
        sae.update(x)
    dz.flush()
    sae.flush()
    dz.comm = sae.comm = None
    return {"deleuzian": dz.state_dict(), "sae": sae.state_dict()}


def quality_extractors(ranks: int = 2, seed: int = 4) -> tuple[Deleuzian, TopKSAE]:
    """Per-rank SAE batch 100 on 2 ranks; one process takes the global batch, 100 * ranks."""
    return (Deleuzian(6, reference_size=512, buffer_size=400, batch_size=200, seed=seed - 2),
            TopKSAE(width=6, k=3, batch_size=200 // ranks, warmup_tokens=200, lr=1e-2, seed=seed))


# ---- fit-level bodies -------------------------------------------------------------------------

class KillSwitch(StreamingKMeans):
    """A k-means that SIGKILLs its process on the n-th update (a crash, no cleanup)."""

    def __init__(self, *args, kill_after: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kill_after, self.calls = kill_after, 0

    def update(self, x, weight=None):
        self.calls += 1
        if self.kill_after is not None and self.calls == self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        super().update(x, weight)


def fit_extractors(kill_after: int | None = None) -> dict:
    return {"blocks.1.resid_out": KillSwitch(n_concepts=4, init_size=48, seed=1, kill_after=kill_after),
            "blocks.0.mlp_out": TopKSAE(width=16, k=3, batch_size=32, warmup_tokens=32, seed=2),
            ("blocks.1.attn.q", "blocks.1.attn.k"): QueryKeyMoments()}


def fit_body(comm: Comm, out: Path, run_dir: str | None, kill: dict | None = None) -> dict:
    from tests.conftest import CharTokenizer, tiny_model

    kill_after = None if kill is None else kill.get(comm.rank)
    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    extractors = fit_extractors(kill_after)
    report = lens.fit(extractors, CORPUS, batch_size=4, max_length=24, checkpoint_dir=run_dir,
                      checkpoint_every=None if run_dir is None else 300, progress=False,
                      filters=FilterConfig(max_norm_ratio=None), distributed=True)
    return {"states": {str(k): e.state_dict() for k, e in extractors.items()}, "tokens": report.tokens,
            "documents": report.documents, "batches": report.batches, "resumed_from": report.resumed_from,
            "kmeans_updates": extractors["blocks.1.resid_out"].calls}


def own_folder_body(comm: Comm, out: Path, cwds: list[str]) -> dict:
    """`fit_body` into the relative run folder "run" from each rank's own working directory: ranks
    on nodes that share no file system, one command line."""
    os.chdir(cwds[comm.rank])
    return fit_body(comm, out, "run")
