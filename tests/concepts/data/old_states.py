"""Checkpoints of the non-SAE extractors written by the code before their states became
dataclasses (commit b2b0d37), and what that code produced after resuming from them: the test
that later code still reads them and continues to the same result (tests/concepts/test_old_states.py).

    git archive b2b0d37 | tar -x -C old && cp -r tests/concepts/data old/tests/concepts/
    cd old && python tests/concepts/data/old_states.py v1       # then copy v1/ here

writes `v1/<case>.pt` (the state after the first chunks; the concept set, statistics and state
after the rest; the state of two replicas of the first state, fed the rest, merged),
`v1/vq_set/` (the codebook's saved ConceptSet) and `v1/fit_checkpoint.pt` (a fit checkpoint
holding a k-means, a codebook and a Deleuzian, as `FitState.save` writes it).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

CASES = {
    "kmeans_pending": ("StreamingKMeans", dict(n_concepts=4, batch_size=16, init_size=200, reseed_after=1.0), 1),
    "kmeans": ("StreamingKMeans", dict(n_concepts=4, batch_size=16, init_size=24, reseed_after=1.0), 1),
    "kmeans_spherical_bf16": ("StreamingKMeans", dict(n_concepts=4, spherical=True, init_size=24, dtype="bfloat16"), 1),
    "sharded_kmeans": ("ShardedKMeans", dict(n_concepts=4, batch_size=16, init_size=24, reseed_after=1.0), 1),
    "vq": ("VQCodebook", dict(n_codes=4, init_size=24, batch_size=8, reseed_after=2), 1),
    "vq_plain": ("VQCodebook", dict(n_codes=4, init="random", init_size=24, reseed_after=3), 1),
    "sharded_vq": ("ShardedVQ", dict(n_codes=4, init_size=24, batch_size=8, reseed_after=2), 1),
    "clvq_mlp": ("CLVQTranscoder", dict(n_codes=4, hidden=8, batch_size=8, codebook=dict(init_size=16)), 2),
    "clvq_transformer": ("CLVQTranscoder", dict(n_codes=4, hidden=8, decoder="transformer", layers=1, heads=2,
                                                batch_size=8, codebook=dict(init_size=16)), 3),
    "deleuzian": ("Deleuzian", dict(n_concepts=3, reference_size=32, buffer_size=32, batch_size=16), 1),
    "deleuzian_paper": ("Deleuzian", dict(n_concepts=3, reference_size=32, buffer_size=32, batch_size=16,
                                          mode="paper", max_differences=40), 1),
}
"""case -> (class, its arguments, what update takes: 1 tensor, source and target, or those and sequence ids)."""
CUT = 3
"""The checkpoint is taken after this many chunks."""
FIT = ("kmeans", "vq", "deleuzian")
"""The cases whose extractors the fit checkpoint holds (one site each)."""
TEXTS = [f"document {i}" for i in range(5)]
"""The documents the fit checkpoint says it consumed (the first CUT of them)."""


def make(case: str):
    from conceptlens.concepts import clvq, deleuzian, kmeans, sharded, vq, vq_sharded

    name, kwargs, _ = CASES[case]
    if name in ("VQCodebook", "ShardedVQ") and hasattr(vq.VQConfig, "distance"):  # as the code of b2b0d37 sampled
        kwargs = {**kwargs, "distance": "euclidean"}
    for module in (kmeans, sharded, vq, vq_sharded, clvq, deleuzian):
        if hasattr(module, name):
            return getattr(module, name)(seed=0, **kwargs)
    raise KeyError(name)


def stream(case: str, n_chunks: int = 7, d: int = 6) -> list[tuple]:
    """Update arguments: chunks of uneven sizes, far from mean 0 and scale 1."""
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(9, 30, (n_chunks,), generator=g).tolist()
    kind = CASES[case][2]
    out = []
    for i, n in enumerate(sizes):
        sites = [2 + 3 * torch.randn(n, d, generator=g).relu() for _ in range(min(kind, 2))]
        if kind == 3:
            sites.append(torch.arange(n) // 5 + 10 * i)
        out.append(tuple(sites))
    return out


def feed(extractor, chunks):
    for args in chunks:
        extractor.update(*args)
    return extractor


def written(extractor) -> dict:
    """What the fitted extractor gives a user: its concept set's tensors, its statistics, its state."""
    cs = extractor.concept_set()
    return {"directions": cs.directions, "encoder": dict(cs.encoder), "stats": _numbers(extractor.stats()),
            "state": extractor.state_dict()}


def _numbers(stats) -> list[float]:
    """The numbers of a (nested) NamedTuple of statistics, in order."""
    return [x for v in stats for x in (_numbers(v) if isinstance(v, tuple) else [float(v)])]


def merged(case: str, state: dict) -> dict:
    """Two replicas of `state` (a shared start), each fed half of the later chunks, merged."""
    chunks = stream(case)[CUT:]
    a, b = make(case), make(case)
    a.load_state_dict(copy.deepcopy(state))  # (b2b0d37's CLVQ kept Adam's step counters of the dict it loaded)
    b.load_state_dict(copy.deepcopy(state))
    if hasattr(a, "mark_shared_start"):
        a.mark_shared_start()
        b.mark_shared_start()
    feed(a, chunks[::2])
    a.merge(feed(b, chunks[1::2]))
    return a.state_dict()


def fit_state(extractors: dict):
    """A `FitState` over `extractors` as a fit makes one (a fixed fingerprint: no model)."""
    from conceptlens.checkpoint import FitState
    from conceptlens.filters import FilterConfig, RowFilter

    fingerprint = {"model": "old-states", "extractors": sorted(extractors), "batching": {"batch_size": 2}}
    return FitState(RowFilter(FilterConfig()), extractors, fingerprint)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    for case in CASES:
        chunks = stream(case)
        first = feed(make(case), chunks[:CUT])
        state = first.state_dict()
        later = feed(first, chunks[CUT:])
        merge = None if case.startswith("sharded") else merged(case, state)
        torch.save({"state": state, "after": written(later), "merged": merge}, out / f"{case}.pt")
        if case == "vq":
            later.concept_set().save(out / "vq_set")
    run = fit_state({case: feed(make(case), stream(case)[:CUT]) for case in FIT})
    for doc in TEXTS[:CUT]:
        run.advance([doc], 7)
    run.save(out / "fit_checkpoint.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
