"""Bodies of the sharded-dictionary tests, run in spawned gloo ranks (not collected: no test_ prefix)."""

from __future__ import annotations

from pathlib import Path

import torch

from conceptlens.concepts.sae.sharded import ShardedTopKSAE
from conceptlens.concepts.sharded import ShardedKMeans
from conceptlens.concepts import StreamingKMeans, TopKSAE
from tests.distributed_workers import global_batches, sae_batches

KMEANS = dict(init_size=150, reseed_after=0.5, seed=3)  # reseeding happens: idle centres are moved
SAE = dict(width=41, k=3, batch_size=32, buffer_size=32, warmup_tokens=64, dead_after=40, k_aux=4, seed=5)


def kmeans(sharded: bool, k: int = 15) -> StreamingKMeans:
    return (ShardedKMeans if sharded else StreamingKMeans)(k, **KMEANS)


def sae(sharded: bool) -> TopKSAE:
    return (ShardedTopKSAE if sharded else TopKSAE)(**SAE)


def feed(km: StreamingKMeans, ae: TopKSAE, steps: slice = slice(None)) -> None:
    """The same rows on every rank, as fit(..., distributed=True) gives them."""
    for x, _ in global_batches()[steps]:
        km.update(x)
    for x in sae_batches()[steps]:
        ae.update(x)


def outcome(km: StreamingKMeans, ae: TopKSAE) -> dict:
    cs = ae.concept_set()
    return {"centres": km.concept_set().directions, "mass": km.mass, "reseeded": km.n_reseeded,
            "directions": cs.directions, "encoder": cs.encoder, "frequency": cs.stats["firing_frequency"],
            "stats": ae.stats(), "encode": ae.encode(sae_batches()[0][:5])}


def sharded_body(comm, out: Path, resume_at: int | None = None) -> dict:
    """Sharded k-means and TopK SAE on the global rows; with `resume_at`, stopped there, saved,
    rebuilt from each rank's state and continued."""
    km, ae = kmeans(True), sae(True)
    if resume_at is None:
        feed(km, ae)
    else:
        feed(km, ae, slice(None, resume_at))
        states = km.state_dict(), ae.state_dict()
        km, ae = ShardedKMeans.from_state(states[0]), ShardedTopKSAE.from_state(states[1])
        feed(km, ae, slice(resume_at, None))
    return {**outcome(km, ae), "shard_rows": (km.state_dict()["centres"].shape[0], ae.params["W_dec"].shape[0]),
            "dead_steps": ae.stats().steps}
