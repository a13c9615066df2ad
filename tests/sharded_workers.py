"""Bodies of the sharded-dictionary tests, run in spawned gloo ranks (not collected: no test_ prefix)."""

from __future__ import annotations

from pathlib import Path

import torch

from conceptlens.concepts.sae.sharded import ShardedTopKSAE
from conceptlens.concepts.sharded import ShardedKMeans
from conceptlens.concepts import ShardedVQ, StreamingKMeans, TopKSAE, VQCodebook
from tests.distributed_workers import global_batches, sae_batches

KMEANS = dict(init_size=150, reseed_after=0.5, seed=3)  # reseeding happens: idle centres are moved
SAE = dict(width=41, k=3, batch_size=32, buffer_size=32, warmup_tokens=64, dead_after=40, k_aux=4, seed=5)
VQ = {  # 15 codes (shards of 8 and 7); dead codes are reseeded; top_k 9 is more than a shard holds
    "vq": dict(init_size=128, top_k=3, reseed_after=4, reseed_threshold=0.5, seed=2),
    "vq-spherical": dict(init="spherical_kmeans", top_k=9, batch_size=40, init_size=128, reseed_after=3,
                         reseed_threshold=0.5, seed=1),
    "vq-random": dict(init="random", init_size=100, top_k=1, seed=0)}


def kmeans(sharded: bool, k: int = 15) -> StreamingKMeans:
    return (ShardedKMeans if sharded else StreamingKMeans)(k, **KMEANS)


def sae(sharded: bool) -> TopKSAE:
    return (ShardedTopKSAE if sharded else TopKSAE)(**SAE)


def vqs(sharded: bool) -> dict[str, VQCodebook]:
    return {name: (ShardedVQ if sharded else VQCodebook)(15, **kw) for name, kw in VQ.items()}


def feed(km: StreamingKMeans, ae: TopKSAE, steps: slice = slice(None), codebooks: dict | None = None) -> None:
    """The same rows on every rank, as fit(..., distributed=True) gives them (flushed at the end)."""
    for x, _ in global_batches()[steps]:
        km.update(x)
        for vq in (codebooks or {}).values():
            vq.update(x)
    for x in sae_batches()[steps]:
        ae.update(x)
    for vq in (codebooks or {}).values():
        if steps.stop is None:
            vq.flush()


def outcome(km: StreamingKMeans, ae: TopKSAE, codebooks: dict | None = None) -> dict:
    cs = ae.concept_set()
    out = {"centres": km.concept_set().directions, "mass": km.mass, "reseeded": km.n_reseeded, "kstats": km.stats(),
           "directions": cs.directions, "encoder": cs.encoder, "frequency": cs.stats["firing_frequency"],
           "stats": ae.stats(), "encode": ae.encode(sae_batches()[0][:5])}
    for name, vq in (codebooks or {}).items():
        book, x = vq.concept_set(), global_batches()[0][0]
        out[name] = {"codes": book.directions, "stats": book.stats, "mean": book.mean, "fit": vq.stats(),
                     "fvu": vq.state_dict()["fitted"]["fvu"], "assign": vq.assign(x), "quantize": vq.quantize(x)}
    return out


def sharded_body(comm, out: Path, resume_at: int | None = None) -> dict:
    """Sharded k-means and TopK SAE on the global rows; with `resume_at`, stopped there, saved,
    rebuilt from each rank's state and continued."""
    km, ae, books = kmeans(True), sae(True), vqs(True)
    if resume_at is None:
        feed(km, ae, codebooks=books)
    else:
        feed(km, ae, slice(None, resume_at), books)
        states = km.state_dict(), ae.state_dict()
        km, ae = ShardedKMeans.from_state(states[0]), ShardedTopKSAE.from_state(states[1])
        books = {name: ShardedVQ.from_state(vq.state_dict()) for name, vq in books.items()}
        feed(km, ae, slice(resume_at, None), books)
    rows = (km.state_dict()["centres"].shape[0], ae.params["W_dec"].shape[0], books["vq"].fitted.codes.shape[0])
    return {**outcome(km, ae, books), "shard_rows": rows, "dead_steps": ae.stats().steps}


def init_body(comm, out: Path, width: int, d: int) -> dict:
    """A ShardedTopKSAE's initial parameters, and the most numbers any tensor made while drawing them held."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            sizes = [t.numel() for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
            self.numel = max([self.numel, *sizes])
            return result

    sae = ShardedTopKSAE(width=width, k=4, seed=7)
    x = torch.randn(64, d, generator=torch.Generator().manual_seed(1))
    with Largest() as seen:
        params = sae._init_params(x)
    return {"params": params, "largest": seen.numel, "slice": (sae.shards.lo, sae.shards.hi),
            "after": torch.rand(4, generator=sae.trainer.generator)}


def sae_outcome(ae: TopKSAE) -> dict:
    cs = ae.concept_set()
    return {"directions": cs.directions, "encoder": cs.encoder, "frequency": cs.stats["firing_frequency"],
            "stats": ae.stats(), "encode": ae.encode(sae_batches()[0][:5])}


def traffic_body(comm, out: Path) -> dict:
    """A ShardedTopKSAE fed the SAE rows, counting the process group's collectives and the steps
    whose AuxK ran; then its outcome (gathered after the count)."""
    import torch.distributed as dist

    calls = {"collectives": 0, "aux_steps": 0}
    for name in ("all_reduce", "all_gather", "broadcast", "all_gather_object", "gather_object", "gather"):
        def counted(*args, _inner=getattr(dist, name), **kwargs):
            calls["collectives"] += 1
            return _inner(*args, **kwargs)
        setattr(dist, name, counted)
    ae = sae(True)
    penalty = ae._penalty

    def noting(*args):
        calls["aux_steps"] += ae._aux is not None
        return penalty(*args)
    ae._penalty = noting
    for x in sae_batches():
        ae.update(x)
    return {**calls, "steps": ae.stats().steps, "outcome": sae_outcome(ae)}


def two_points(sharded: bool) -> StreamingKMeans:
    """Four centres on rows of two distinct points: k-means++ seeds two centres that receive no mass."""
    km = (ShardedKMeans if sharded else StreamingKMeans)(4, init_size=16, reseed_after=None, seed=0)
    km.update(torch.tensor([[0.0, 0.0], [10.0, 10.0]]).repeat(8, 1))
    km.flush()
    return km


def live_body(comm, out: Path) -> dict:
    km = two_points(True)
    return {"stats": km.stats(), "mass": km.mass}
