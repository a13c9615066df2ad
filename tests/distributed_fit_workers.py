"""Fit-level bodies for tests/test_distributed_equal.py and tests/test_distributed_failures.py,
run in spawned gloo ranks by `tests.distributed_workers.spawn` (not collected: no test_ prefix)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import conceptlens
from conceptlens.concepts import Deleuzian, StreamingKMeans, TopKSAE, VQCodebook
from conceptlens.distributed import Comm
from conceptlens.filters import FilterConfig
from conceptlens.metrics.gauge import QueryKeyMoments
from tests.distributed_workers import CORPUS


# ---- a distributed fit equals one process with the global batch --------------------------------

class TokenLog:
    """A token-aware statistic (as the description pass is): it keeps every row's document,
    position and norm, and every batch's token ids, in the order the fit gives them."""

    def __init__(self) -> None:
        self.doc, self.pos, self.norm, self.ids = [], [], [], []

    def update(self, x, tokens) -> None:
        self.doc.append(tokens.doc.cpu())
        self.pos.append(tokens.pos.cpu())
        self.norm.append(x.norm(dim=1))
        self.ids.append(tokens.ids.cpu())

    def state_dict(self) -> dict:
        return {"doc": torch.cat(self.doc), "pos": torch.cat(self.pos), "norm": torch.cat(self.norm),
                "ids": list(self.ids)}


def equal_extractors() -> dict:
    """One of each extractor kind, several at one site; mixing buffers and pairings on; a
    token-aware statistic."""
    from conceptlens.concepts import CLVQTranscoder
    from conceptlens.concepts.sae import CrossLayerTranscoder, Crosscoder

    return {"blocks.1.resid_out": {
                "km": StreamingKMeans(4, init_size=200, seed=1),
                "dz": Deleuzian(4, reference_size=64, buffer_size=96, batch_size=48, seed=2),
                "dz-paper": Deleuzian(4, mode="paper", reference_size=256, max_differences=512, max_iter=20,
                                      seed=3),
                "topk": TopKSAE(width=16, k=3, batch_size=32, buffer_size=96, warmup_tokens=32, seed=4),
                "vq": VQCodebook(6, init_size=96, batch_size=64, buffer_size=128, seed=5)},
            "blocks.0.mlp_out": {"tokens": TokenLog()},
            ("blocks.1.attn.q", "blocks.1.attn.k"): QueryKeyMoments(),
            ("blocks.0.resid_out", "blocks.1.resid_out"): CLVQTranscoder(4, hidden=16, batch_size=64, seed=6),
            ("blocks.0.resid_out", "blocks.1.resid_out", "blocks.1.mlp_out"):
                Crosscoder(width=16, k=3, batch_size=32, buffer_size=96, warmup_tokens=32, seed=7),
            (("blocks.0.mlp.in", "blocks.1.mlp.in"), ("blocks.0.mlp_out", "blocks.1.mlp_out")):
                CrossLayerTranscoder(width=16, k=2, batch_size=32, buffer_size=96, warmup_tokens=32, seed=8)}


EQUAL_FILTERS = FilterConfig(max_norm_ratio=1.15, window=64)  # tight enough that the global median matters


def equal_fit(batch_size: int, distributed: bool, run_dir: str | None = None, corpus: list[str] = CORPUS,
              max_tokens: int | None = None, extractor_tokens: dict[str, int] | None = None) -> dict:
    """The states of `equal_extractors` after a fit of `corpus` (flat: name -> state), its rows and tokens."""
    from tests.conftest import CharTokenizer, tiny_model

    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    extractors = equal_extractors()
    report = lens.fit(extractors, corpus, batch_size=batch_size, max_length=24, progress=False,
                      filters=EQUAL_FILTERS, distributed=distributed, checkpoint_dir=run_dir,
                      checkpoint_every=None if run_dir is None else 400, max_tokens=max_tokens,
                      extractor_tokens=extractor_tokens or {})
    flat = {}
    for key, value in extractors.items():
        for name, ext in (value.items() if isinstance(value, dict) else [(str(key), value)]):
            flat[name] = ext.state_dict()
    return {"states": flat, "rows": report.rows, "tokens": report.tokens, "resumed_from": report.resumed_from}


def equal_body(comm: Comm, out: Path, run_dir: str | None = None, corpus: list[str] = CORPUS,
               max_tokens: int | None = None, extractor_tokens: dict[str, int] | None = None) -> dict:
    return equal_fit(4, True, run_dir, corpus, max_tokens, extractor_tokens)


SHORT_CORPUS = [f"doc {i} " + "ab" * (i % 6) for i in range(24)]
"""Documents shorter than max_length and of varied lengths: in most steps one rank's batch is wider than the other's."""


def padded_fit(batch_size: int, distributed: bool) -> dict:
    """A JumpReLU SAE (whose threshold turns a rounding difference in a row into another code) and a
    TopK SAE after a fit of SHORT_CORPUS: states and tokens."""
    from conceptlens.concepts.sae import JumpReLUSAE
    from tests.conftest import CharTokenizer, tiny_model

    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    extractors = {"jump": JumpReLUSAE(width=8, batch_size=16, buffer_size=32, warmup_tokens=16, seed=1),
                  "topk": TopKSAE(width=8, k=2, batch_size=16, buffer_size=32, warmup_tokens=16, seed=2)}
    report = lens.fit({"blocks.1.resid_out": extractors}, SHORT_CORPUS, batch_size=batch_size, max_length=24,
                      progress=False, distributed=distributed)
    return {"states": {k: e.state_dict() for k, e in extractors.items()}, "tokens": report.tokens}


def padded_body(comm: Comm, out: Path) -> dict:
    return padded_fit(4, True)


def routed_fit(batch_size: int, distributed: bool, run_dir: str | None = None) -> dict:
    """Two k-means at two sites (a distributed fit updates them on ranks 1 and 0): states, rows, tokens."""
    from tests.conftest import CharTokenizer, tiny_model

    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    extractors = {"blocks.0.resid_out": StreamingKMeans(3, init_size=60, seed=1),
                  "blocks.1.resid_out": StreamingKMeans(3, init_size=60, seed=2)}
    report = lens.fit(extractors, CORPUS, batch_size=batch_size, max_length=24, progress=False,
                      filters=EQUAL_FILTERS, distributed=distributed, checkpoint_dir=run_dir,
                      checkpoint_every=None if run_dir is None else 400)
    return {"states": {k: e.state_dict() for k, e in extractors.items()}, "rows": report.rows, "tokens": report.tokens}


def routed_body(comm: Comm, out: Path, run_dir: str) -> dict:
    """`routed_fit` on this rank, noting the sites whose rows it received and filtered."""
    from conceptlens.distributed import DistributedRun
    from conceptlens.filters import RowFilter

    seen: dict[str, set] = {"received": set(), "filtered": set()}
    gather, keep = DistributedRun.gather_step, RowFilter.__call__

    def received(self, *args, **kwargs):
        step = gather(self, *args, **kwargs)
        seen["received"] |= set(step.acts)
        return step

    def filtered(self, site, *args):
        seen["filtered"].add(site)
        return keep(self, site, *args)
    DistributedRun.gather_step, RowFilter.__call__ = received, filtered
    return {**routed_fit(4, True, run_dir), **{k: sorted(v) for k, v in seen.items()}}


# ---- ranks that run different fits ----------------------------------------------------------------

MISMATCHES = {  # what rank 1 changes -> (model seed, corpus, extractor, fit options) of rank 1
    "documents": dict(corpus=CORPUS[1:] + CORPUS[:1]),
    "model": dict(seed=1),
    "k": dict(k=5),
    "batch_size": dict(batch_size=3),
    "max_tokens": dict(max_tokens=500),
}


def mismatch_body(comm: Comm, out: Path) -> dict:
    """For each entry of MISMATCHES, a fit whose rank 1 differs in that one thing; the message each rank got."""
    from conceptlens.distributed import DistributedError
    from tests.conftest import CharTokenizer, tiny_model

    messages = {}
    for case, change in MISMATCHES.items():
        mine = change if comm.rank == 1 else {}
        lens = conceptlens.attach(tiny_model("llama", seed=mine.get("seed", 0)), CharTokenizer())
        try:
            lens.fit({"blocks.1.resid_out": StreamingKMeans(mine.get("k", 4), seed=1)}, mine.get("corpus", CORPUS),
                     batch_size=mine.get("batch_size", 4), max_tokens=mine.get("max_tokens"), max_length=24,
                     progress=False, distributed=True)
            messages[case] = None
        except DistributedError as err:
            messages[case] = str(err)
    return messages


def lonely_body(out: Path, port: int, timeout_s: float) -> None:
    """Rank 0 of 2 whose rank 1 never starts: lens.fit joins the group itself (no group beforehand)."""
    from tests.conftest import CharTokenizer, tiny_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="2",
                      CONCEPTLENS_DIST_TIMEOUT=str(timeout_s))
    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    try:
        lens.fit({"blocks.1.resid_out": StreamingKMeans(4)}, CORPUS, progress=False, distributed=True)
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        (out / "rank0.err").write_text(f"{type(err).__name__}: {err}")
        os._exit(1)


def die_body(comm: Comm, out: Path, who: int) -> None:
    """Rank `who` exits (a crash) once every rank has joined the group (else, on a busy machine, a
    survivor still joining would fail there, not in the all-reduce); the others run one all-reduce."""
    store = dist.distributed_c10d._get_default_store()
    store.add("joined", 1)
    if comm.rank == who:
        while store.add("joined", 0) < comm.world:
            time.sleep(0.01)
        os._exit(3)
    comm.sum_(torch.ones(1))


def quiesce_body(comm, out: Path, leave: bool) -> dict:
    """Rank 1 writes a mark, then quiesces (or, with `leave`, exits without it); rank 0 quiesces at
    once and reports whether the mark was there when its quiesce returned."""
    from conceptlens.distributed import quiesce

    mark = out / "rank1-arrived"
    if comm.rank == 1:
        time.sleep(1.0)  # rank 0 is in its quiesce by now: without a barrier it would not see the mark
        mark.write_text("here")
        if leave:
            os._exit(0)
        quiesce()
        return {}
    quiesce(timeout_s=20.0)
    return {"mark_seen": mark.exists()}
