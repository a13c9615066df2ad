"""Which rank of a distributed fit updates which extractor, and how the others get its state.

    owners({"a": km, "b": sae, "c": sharded_vq}, world=2)   # {"a": 1, "b": 0, "c": None}

The rows of a step are the same on every rank, so an extractor not sharded would be updated W
times to the same result: it is updated on one rank, the i-th in name order on rank
W - 1 - i % W (rank 0, which also writes the files, gets the fewest), and its state reaches
the other ranks at a checkpoint (on rank 0, `fill_ranks`) and at the end of the fit (`share`,
one broadcast each), so the ranks end identical. A sharded extractor (one with a `shards`
split: `ShardedKMeans`, `ShardedVQ`, `ShardedTopKSAE`) is updated on every rank, each on its
slice; so is one without `state_dict` and `load_state_dict` (its state could not travel).
The rows of a site read only by extractors of one rank go to that rank alone (`readers`),
which alone filters them; the row filter's state of each site is taken from its first reader
at a checkpoint and at the end (`first_reads`, `merge_rows`).
"""

from __future__ import annotations

from typing import Any


def sharded(extractor: Any) -> bool:
    """Whether the extractor holds a different part on each rank (it has a `shards` split; read
    inside the fit, where the process group exists)."""
    return hasattr(extractor, "shards")


def owners(extractors: dict[str, Any], world: int) -> dict[str, int | None]:
    """Extractor name -> the rank that updates it (None: every rank)."""
    movable = sorted(name for name, e in extractors.items() if not sharded(e) and all(
        callable(getattr(e, method, None)) for method in ("state_dict", "load_state_dict")))
    out: dict[str, int | None] = {name: None for name in extractors}
    out.update({name: world - 1 - i % world for i, name in enumerate(movable)})
    return out


def share(comm: Any, owned: dict[str, int | None], extractors: dict[str, Any]) -> None:
    """Every rank's copy of each extractor with an owner becomes the owner's (a `Comm` broadcast each)."""
    for name in sorted(extractors):
        owner = owned.get(name)
        if owner is None:
            continue
        mine = owner == comm.rank
        state = comm.broadcast_object(extractors[name].state_dict() if mine else None, src=owner)
        if not mine:
            extractors[name].load_state_dict(state)


def fill_ranks(states: list[dict[str, Any]], owned: dict[str, int | None]) -> list[dict[str, Any]]:
    """Every rank's checkpoint state (`states[r]["extractors"]` holding what rank r updates),
    each rank's entry completed with the owners' states: the same objects, which torch.save
    writes once."""
    sent = [state["extractors"] for state in states]
    return [{**state, "extractors": {name: sent[rank if owner is None else owner][name]
                                     for name, owner in owned.items()}} for rank, state in enumerate(states)]


def readers(owned: dict[str, int | None], sites: dict[str, tuple[str, ...]], world: int) -> dict[str, list[int] | None]:
    """Site -> the ranks that update an extractor reading it (None: every rank). `sites`: extractor
    name -> the sites it reads."""
    out: dict[str, set[int] | None] = {}
    for name, read in sites.items():
        owner = owned.get(name)
        for site in read:
            ranks = out.setdefault(site, set())
            out[site] = None if owner is None or ranks is None else ranks | {owner}
    return {site: None if ranks is None or len(ranks) == world else sorted(ranks) for site, ranks in out.items()}


def first_reads(rows: dict[str, Any], reading: dict[str, list[int] | None], rank: int) -> dict[str, Any]:
    """The part of a row-filter state (`RowFilter.state_dict()`) for the sites `rank` is the first reader of."""
    first = {site for site, ranks in reading.items() if (ranks or [0])[0] == rank}
    return {part: {site: v for site, v in rows[part].items() if site in first} for part in ("norms", "counts")}


def merge_rows(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One row-filter state from every rank's `first_reads` part (in rank order)."""
    merged: dict[str, Any] = {"norms": {}, "counts": {}}
    for part in parts:
        for kind in merged:
            merged[kind].update(part[kind])
    return merged
