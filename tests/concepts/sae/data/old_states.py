"""SAE checkpoints written by older code, and what that code produced after resuming from
them: the test that later code still reads them and continues bit for bit
(tests/concepts/sae/test_old_states.py). `v1/`: written before the SAEs became modules (commit
2d765d2); `v2/`: by the modules that still trained themselves (commit b2b0d37, before
`SAETrainer`).

    git archive 2d765d2 | tar -x -C old && cd old && python tests/concepts/sae/data/old_states.py OUT

writes `OUT/<case>.pt` (the state after the first chunks; the concept set and statistics after
the rest) and `OUT/topk_set/` (a ConceptSet; v1's is saved under the old method name "topk_sae").
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

SMALL = dict(width=8, batch_size=16, warmup_tokens=16, buffer_size=32, dead_after=40)
CASES = {
    "relu": ("ReLUSAE", dict(SMALL, l1=0.5), 1),
    "topk": ("TopKSAE", dict(SMALL, k=2), 1),
    "batchtopk": ("BatchTopKSAE", dict(SMALL, k=2), 1),
    "jumprelu": ("JumpReLUSAE", dict(SMALL, l0=0.1, threshold_init=0.1, bandwidth=0.05), 1),
    "spade": ("SpaDE", dict(SMALL), 1),
    "matryoshka": ("MatryoshkaSAE", dict(SMALL, k=2, prefixes=(2, 4, 8)), 1),
    "actmsae": ("ActMSAE", dict(SMALL, k=2, ks=(2, 4, 8)), 1),
    "ewg": ("EWGSAE", dict(SMALL, groups=(2, 4, 8), l1=0.3), 1),
    "mpsae": ("MPSAE", dict(SMALL, k=2), 1),
    "hsae": ("HSAE", dict(parents=4, children=2, subspace=3, k=2, batch_size=16, warmup_tokens=16, buffer_size=32,
                          dead_after=40), 1),
    "transcoder": ("Transcoder", dict(SMALL, l1=0.5), 2),
    "skip_transcoder": ("SkipTranscoder", dict(SMALL, l1=0.5), 2),
    "crosscoder": ("Crosscoder", dict(SMALL, k=2), 2),
    "relu_crosscoder": ("ReLUCrosscoder", dict(SMALL, l1=0.5), 2),
    "clt": ("CrossLayerTranscoder", dict(SMALL, k=2), "groups"),
}
"""case -> (class in conceptlens.concepts.sae, its arguments, what update takes: 1 or 2 tensors,
or two groups of two)."""
CUT = 3
"""The checkpoint is taken after this many chunks (past the warm-up and two steps)."""


def make(case: str):
    import conceptlens.concepts.sae as sae

    name, kwargs, _ = CASES[case]
    return getattr(sae, name)(seed=0, **kwargs)


def stream(case: str, n_chunks: int = 7, d: int = 6) -> list[tuple]:
    """Update arguments: chunks of uneven sizes, far from mean 0 and scale 1."""
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(9, 30, (n_chunks,), generator=g).tolist()
    rows = CASES[case][2]
    n_sites = 4 if rows == "groups" else rows
    out = []
    for n in sizes:
        sites = [2 + 3 * torch.randn(n, d, generator=g).relu() for _ in range(n_sites)]
        out.append((tuple(sites[:2]), tuple(sites[2:])) if rows == "groups" else tuple(sites))
    return out


def feed(extractor, chunks):
    for args in chunks:
        extractor.update(*args)
    return extractor


def written(extractor) -> dict:
    """What the fitted extractor gives a user: its concept set's tensors and its statistics."""
    cs = extractor.concept_set()
    return {"directions": cs.directions, "encoder": dict(cs.encoder), "stats": _numbers(extractor.stats())}


def _numbers(stats) -> list[float]:
    """The numbers of a (nested) NamedTuple of statistics, in order."""
    return [x for v in stats for x in (_numbers(v) if isinstance(v, tuple) else [float(v)])]


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    for case in CASES:
        chunks = stream(case)
        first = feed(make(case), chunks[:CUT])
        state = copy.deepcopy(first.state_dict())  # a module's state_dict shares the live parameters
        later = feed(first, chunks[CUT:])
        torch.save({"state": state, "after": written(later)}, out / f"{case}.pt")
        if case == "topk":
            later.concept_set().save(out / "topk_set")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
