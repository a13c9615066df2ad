"""How the probes read a set's concepts, and its matched random control read the same way.

    readers = probe_readers(sets, ("activation", "code"), draws=5, seed=0)   # column -> (N, d) -> (N, n)
    probed = collect(lens, site, readers, batches)                           # evaluate.activations
    z = probed.z[column("topk", "code")]; control = probed.z[column("topk", "code", draw=0)]

Two readings (`READINGS`), each a reader for the set and one for its control of as many random
unit directions of the site as the set has concepts (`random_directions`, seeds seed + 1
+ draw), applied to every token before a document's tokens are mean-pooled:
- "activation": the suite's definition (`activations.concept_encoder`: an SAE's code, a VQ
  codebook's one-hot code, the cosine to the centred direction for dense sets); the control by
  the cosine to the random directions centred on the set's mean, or by the projection when the
  set carries no mean (SAEs). Centred as the set's directions are (`ConceptSet.centred`): a set of
  differences (Deleuzian, random) has its directions' component along the mean taken out, and so
  has its control's; points near the mean (k-means, VQ) become `c - mean`, arbitrary directions,
  matched by random directions as drawn. A set of random directions is thus read exactly as its
  own control would be.
- "code": every set by its nonlinear code, the control through the same nonlinearity: an SAE's
  code (SAEBench's reading: mean-pooled latent activations) against a random encoder of the same
  width, k and decoder bias (TopK: `topk_relu((x - b_dec) @ R.T, k)`; an SAE without k, such as
  JumpReLU, against a plain ReLU of that: no threshold, so its control is denser than its code), a dense
  set's assigned concept (one-hot; nearest centre for k-means, largest cosine otherwise,
  `describe.activations`) against the one-hot random direction of largest cosine.

Memory: readers that read alike are one object (`reader_key`; e.g. the controls of SAEs of one
width), read once. A probe needs of a column only its top latents by mean difference and those
latents of every row (`choose`), so a token-level column (`activations.TokenColumns`: tokens x
width, per set, reading and draw) is read batch by batch, twice, and never held whole.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from conceptlens.concepts.conceptset import DIFFERENCE_METHODS, ConceptSet
from conceptlens.evaluate.activations import TokenColumns

READINGS = ("activation", "code")

READ_NOTE = {"activation": "concepts read by their activations (an SAE's code, a dense concept's cosine), "
                           "random directions linearly (an SAE's control by projection, keeping what TopK drops; "
                           "a dense set's by cosine)",
             "code": "concepts read by their codes (an SAE's TopK code, a dense set's assigned concept), random "
                     "directions through the same nonlinearity (a random TopK encoder, the largest cosine)"}

Reader = Callable[[Tensor], Tensor]
"""`(N, d)` site activations -> `(N, n)` what the probe reads"""


def check_reading(reading: str) -> None:
    if reading not in READINGS:
        raise ValueError(f"unknown probe reading {reading!r}; choose one of {', '.join(READINGS)}")


def random_directions(n: int, d: int, seed: int) -> Tensor:
    """`(n, d)` unit directions drawn uniformly on the sphere."""
    return F.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=1)


def column(name: str, reading: str = "activation", draw: int | None = None) -> str:
    """The `Probed.z` key of set `name` read by `reading`, or of its control's `draw` (set names are
    folder names, so they hold no '/'); the activation reading of a set is its plain name."""
    key = name if reading == "activation" else f"{name}/{reading}"
    return key if draw is None else f"{key}/random {draw}"


def set_reader(cs: ConceptSet, reading: str = "activation") -> Reader:
    """`cs`'s concepts as the probe reads them (see the module docstring)."""
    from conceptlens.concepts.sae.restore import CLASSES
    from conceptlens.describe.activations import concept_activations
    from conceptlens.evaluate.activations import concept_encoder

    check_reading(reading)
    if reading == "activation" or cs.method in CLASSES:
        return concept_encoder(cs).encode
    act = concept_activations(cs)
    assign = act.assign_fn
    if assign is None:
        raise ValueError(f"a {cs.method!r} set assigns no concept to a token; read it with reading='activation'")
    return lambda x: F.one_hot(assign(act.encode(x.float()), x.float()), len(cs)).float()


def control_reader(cs: ConceptSet, seed: int, reading: str = "activation", directions: Tensor | None = None,
                   activation: Reader | None = None) -> Reader:
    """`len(cs)` random unit directions of the site (seeded; or `directions`, as `random_directions` drew
    them), read as `cs`'s concepts are. A dense set's code control is the one-hot largest of its
    activation control's output: given that reader (`activation`, on the same directions), it is
    `Derived` from it, so `pool_documents` computes their product once."""
    from conceptlens.concepts.sae.restore import CLASSES
    from conceptlens.concepts.sae.topk import topk_relu
    from conceptlens.evaluate.activations import Derived, concept_encoder

    check_reading(reading)
    n = len(cs)
    directions = random_directions(n, cs.d, seed) if directions is None else directions
    if reading == "code" and cs.method in CLASSES:
        b_dec = cs.encoder["b_dec"].float()
        k = cs.config.get("k")
        if k is None:
            return lambda x: torch.relu((x.float() - b_dec) @ directions.T)
        return lambda x: topk_relu((x.float() - b_dec) @ directions.T, min(int(k), n))
    if reading == "code" and activation is not None:
        return Derived(activation, lambda z: F.one_hot(z.argmax(1), n).float())
    if cs.mean is None:
        linear: Reader = lambda x: x.float() @ directions.T
    else:  # centred as the set's are: unflagged, a "random" set (a difference method) loses its mean component
        flag = {} if _differences(cs) else {"centred": True}
        randoms = ConceptSet(directions, cs.site, method="random", mean=cs.mean, config=flag)
        linear = concept_encoder(randoms).encode
    if reading == "code":
        return lambda x: F.one_hot(linear(x).argmax(1), n).float()
    return linear


def probe_readers(sets: Mapping[str, ConceptSet], readings: Sequence[str] = READINGS, *, draws: int,
                  seed: int = 0) -> dict[str, Reader]:
    """column -> reader: every set by every reading and its control's `draws` (seeds seed + 1 + draw).
    An SAE's code is its activation: its code column is its activation column's reader, so that every
    reading has all its columns. Readers that would read alike are one object under several columns
    (`reader_key`: e.g. the controls of SAEs of one width), which `activations.collect` reads once; a
    dense set's code control derives from its activation control (`control_reader`), read once for both."""
    out: dict[str, Reader] = {}
    made: dict[tuple, Reader] = {}
    drawn: dict[tuple[int, int, int], Tensor] = {}  # one draw of directions serves both readings
    slashed = [name for name in sets if "/" in name]
    if slashed:
        raise ValueError(f"set name {slashed[0]!r} holds a '/', which separates a set's columns; rename it")
    for reading in readings:
        check_reading(reading)
        for name, cs in sets.items():
            key = reader_key(cs, reading, name=name)
            if key not in made:
                made[key] = set_reader(cs, reading)
            out[column(name, reading)] = made[key]
            for r in range(draws):
                key, size = reader_key(cs, reading, seed=seed + 1 + r), (len(cs), cs.d, seed + 1 + r)
                if size not in drawn:
                    drawn[size] = random_directions(*size)
                if key not in made:
                    made[key] = control_reader(cs, seed + 1 + r, reading, drawn[size],
                                               made.get(reader_key(cs, "activation", seed=seed + 1 + r)))
                out[column(name, reading, r)] = made[key]
    return out


def reader_key(cs: ConceptSet, reading: str, *, name: str | None = None, seed: int | None = None) -> tuple:
    """What set `name`'s reader (or, given `seed`, its control's) depends on: equal keys read alike.
    A control depends on the set's size, width and what its reading takes from the set (an SAE's k
    and b_dec for codes, the mean it is centred on), not on the set's concepts."""
    from conceptlens.concepts.sae.restore import CLASSES

    sae = cs.method in CLASSES
    if seed is None:
        return ("set", name) if sae else ("set", name, reading)  # an SAE's code reading is its activation
    held = lambda t: None if t is None else (str(t.dtype), t.float().numpy().tobytes())
    if reading == "code" and sae:
        k = cs.config.get("k")
        return ("random encoder", len(cs), cs.d, seed, None if k is None else min(int(k), len(cs)),
                held(cs.encoder["b_dec"]))
    return ("random directions", reading, len(cs), cs.d, seed, held(cs.mean), _differences(cs))


def _differences(cs: ConceptSet) -> bool:
    """Whether `cs`'s directions are differences of activations, centred by taking out their component
    along the mean (`ConceptSet.centred`): its control's directions are centred so too."""
    return cs.method in DIFFERENCE_METHODS


def column_blocks(z: Mapping[str, Tensor], name: str) -> Iterable[Tensor]:
    """Column `name` of `Probed.z` as consecutive `(N_b, n)` row blocks: a `TokenColumns` reads one batch
    at a time; a stored column is one block."""
    return z.blocks(name) if isinstance(z, TokenColumns) else (z[name],)


def mean_differences(blocks: Iterable[Tensor], sides: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
    """`(tasks, n)` float64: per task, the mean of a column over its rows of ids `sides[task][0]` minus
    that over `sides[task][1]` (sorted ids; `probing.sides`: class 1 and class 0 of its train split),
    the column given as consecutive row blocks and summed block by block (one block: exactly
    `probing.top_mean_difference`'s means, as torch's mean is the sum over the count)."""
    sums: Tensor | None = None
    start = 0
    for block in blocks:
        end = start + len(block)
        part = torch.stack([torch.stack([_rows_sum(block, rows, start, end) for rows in pair]) for pair in sides])
        sums, start = part if sums is None else sums + part, end  # (tasks, 2, n)
    if sums is None:
        raise ValueError("mean_differences takes at least one block of rows")
    counts = torch.tensor([[len(rows) for rows in pair] for pair in sides], dtype=torch.float64)
    means = sums / counts[..., None]
    return means[:, 0] - means[:, 1]


def _rows_sum(block: Tensor, rows: Tensor, start: int, end: int) -> Tensor:
    """`(n,)` float64 sum of the rows of ids `rows` (sorted) that fall in the block of rows [start, end)."""
    lo, hi = torch.searchsorted(rows, torch.tensor([start, end])).tolist()
    return block[rows[lo:hi] - start].double().sum(0)


class Chosen(NamedTuple):
    """The latents a column's probes use (per task, the top ones by |mean difference| on the train rows)
    and only those latents of every train and test row: what a probe needs of a wide column."""

    diff: Tensor
    """`(tasks, n)` signed mean differences (`mean_differences`)"""
    features: list[list[Tensor]]
    """per task, per size asked: the indices of the largest |diff|, largest first"""
    keep: Tensor
    """`(U,)` every chosen latent, sorted"""
    train: Tensor
    """`(N_train, U)` the column's `keep` latents of every train row"""
    test: Tensor
    """`(N_test, U)`"""

    def at(self, features: Tensor) -> Tensor:
        """Positions of latents `features` among `train`'s and `test`'s columns."""
        return torch.searchsorted(self.keep, features)


def choose(train: Mapping[str, Tensor], test: Mapping[str, Tensor], name: str,
           sides: Sequence[tuple[Tensor, Tensor]], sizes: Sequence[int]) -> Chosen:
    """Column `name`'s top-k latents by |mean difference| (`mean_differences` over `sides`) per task for
    every k in `sizes`, and those latents of every train and test row (`Probed.z` of each split); a
    `TokenColumns` column is read twice (its mean differences, then the chosen latents), never whole."""
    diff = mean_differences(column_blocks(train, name), sides)
    n = diff.shape[1]
    features = [[d.abs().topk(min(k, n)).indices for k in sizes] for d in diff]
    keep = torch.cat([f for fs in features for f in fs]).unique()
    train_z, test_z = (torch.cat([b[:, keep] for b in column_blocks(z, name)]) for z in (train, test))
    return Chosen(diff, features, keep, train_z, test_z)


__all__ = ["READINGS", "READ_NOTE", "Chosen", "Reader", "check_reading", "choose", "column", "column_blocks",
           "control_reader", "mean_differences", "probe_readers", "random_directions", "reader_key", "set_reader"]
