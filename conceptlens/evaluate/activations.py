"""Concept sets, their activations, and labelled batches: what every part of the suite reads.

    cs = load_concepts("runs/demo", "topk")
    enc = concept_encoder(cs)                 # the one place that says how a set's concepts activate
    feats = collect(lens, site, {"topk": enc}, task_batches(tok, texts, labels, ...))

Concept activations (`concept_encoder`): an SAE set's own encoder (rebuilt with
`sae_from_concept_set`), a VQ codebook's one-hot nearest code, otherwise the atlas's reading:
the cosine of x - mean to each centred direction (`describe.activations`). Documents of bbc-news,
movie-polarity and conll2010-uncertainty are probed as wholes: their activations are averaged over
their real tokens. wsj-pos is probed per token: each word's Penn tag labels its first sub-token
(found through the tokenizer's character offsets); the other sub-tokens go unlabelled. Each sequence's first token, the attention sink,
is always left out (as fits leave it out). Token rows keep only their site activations: their
concept columns are read batch by batch when asked (`TokenColumns`), never held whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from conceptlens._memory import release
from conceptlens.batching import encode_batch
from conceptlens.concepts.conceptset import CONFIG_FILE, ConceptSet
from conceptlens.devices import input_device
from conceptlens.interface import AttachedModel

TOKEN_TASKS = ("wsj-pos",)
"""Labelled sets probed per token; the others are probed per document."""


def concept_set_names(run_dir: str | Path) -> list[str]:
    """The sets in `run_dir/concepts/<name>/`, sorted; `[]` when `run_dir` is itself a set."""
    root = Path(run_dir)
    if (root / CONFIG_FILE).is_file():
        return []
    return sorted(p.name for p in (root / "concepts").glob("*") if (p / CONFIG_FILE).is_file())


def load_concepts(run_dir: str | Path, name: str | None = None) -> ConceptSet:
    """The ConceptSet in `run_dir`, or in `run_dir/concepts/<name>` (the only one if `name` is None)."""
    root = Path(run_dir)
    if (root / CONFIG_FILE).is_file():
        return ConceptSet.load(root)
    found = concept_set_names(root)
    if not found:
        raise FileNotFoundError(f"{root} holds neither a ConceptSet ({CONFIG_FILE}) nor concepts/<name>/ folders")
    if name is None and len(found) > 1:
        raise ValueError(f"{root}/concepts holds {len(found)} sets; choose one with --concepts: {found}")
    name = found[0] if name is None else name
    if name not in found:
        raise ValueError(f"no concept set {name!r} in {root}/concepts; found {found}")
    return ConceptSet.load(root / "concepts" / name)


class ConceptEncoder(NamedTuple):
    kind: str
    """how activations are computed, in words"""
    encode: Callable[[Tensor], Tensor]
    """`(N, d)` -> `(N, n)` concept activations"""
    decode: Callable[[Tensor], Tensor] | None
    """`(N, n)` -> `(N, d)` reconstruction, for sets that reconstruct"""


def concept_encoder(cs: ConceptSet) -> ConceptEncoder:
    """How `cs`'s concepts activate: the set's own encoder when it carries one (SAE, VQ codebook),
    else the atlas's definition (`describe.activations`: the cosine to the centred direction).
    Every part of the suite reads activations through here."""
    from conceptlens.concepts.sae.restore import CLASSES, sae_from_concept_set

    if cs.method in CLASSES:
        sae = sae_from_concept_set(cs)
        return ConceptEncoder(f"{cs.method} encoder", lambda x: sae.encode(x).cpu(), lambda z: sae.decode(z).cpu())
    if cs.method == "vq" and "codebook" in cs.encoder:
        codes = cs.encoder["codebook"].float()
        return ConceptEncoder("one-hot nearest VQ code",
                              lambda x: F.one_hot(torch.cdist(x.cpu().float(), codes).argmin(1), len(codes)).float(),
                              lambda z: z @ codes)
    from conceptlens.describe.activations import concept_activations

    act = concept_activations(cs)  # the atlas's definition: the cosine to the centred direction
    return ConceptEncoder(act.kind, lambda x: act.encode(x.cpu()), None)


# ---- labels and batches ------------------------------------------------------------------

def word_spans(words: list[str]) -> Tensor:
    """Character spans `(W, 2)` of the words in `" ".join(words)`."""
    lengths = torch.tensor([len(w) for w in words])
    starts = torch.cumsum(lengths + 1, 0) - lengths - 1
    return torch.stack([starts, starts + lengths], 1)


def first_subtoken_labels(offsets: Tensor, spans: Tensor, tags: Tensor) -> Tensor:
    """Token labels `(T,)`: the tag of word w on the first token overlapping it, -1 elsewhere.

        first_subtoken_labels(offsets, word_spans(words), tag_ids)   # offsets: (T, 2) char spans

    Tokens with an empty span (special tokens, padding) are never labelled.
    """
    start, end = offsets[:, 0], offsets[:, 1]
    ends = torch.cummax(torch.where(end > start, end, torch.zeros_like(end)), 0).values  # sorted
    first = torch.searchsorted(ends, spans[:, 0].contiguous(), right=True)  # first token ending after the word starts
    ok = first < len(offsets)
    first, spans, tags = first[ok], spans[ok], tags[ok]
    hit = (start[first] < spans[:, 1]) & (end[first] > start[first])
    labels = torch.full((len(offsets),), -1, dtype=torch.long)
    labels[first[hit]] = tags[hit]
    return labels


def task_batches(tok: Any, texts: list[str], labels: list[Any], *, token_level: bool, tag_ids: dict[str, int],
                 batch_size: int, max_length: int) -> Iterator[tuple[dict[str, Tensor], Tensor]]:
    """(batch, labels) pairs: labels `(B,)` per document, or `(B, T)` per token (-1 = unlabelled)."""
    for i in range(0, len(texts), batch_size):
        chunk, chunk_labels = texts[i:i + batch_size], labels[i:i + batch_size]
        batch = encode_batch(tok, chunk, max_length, offsets=token_level)
        if not token_level:
            yield batch, torch.tensor(chunk_labels)
            continue
        offsets = batch.pop("offset_mapping")
        rows = [first_subtoken_labels(off, word_spans(text.split(" ")),
                                      torch.tensor([tag_ids.get(t, -1) for t in tags]))
                for off, text, tags in zip(offsets, chunk, chunk_labels)]
        yield batch, torch.stack(rows)


def pick(n: int, k: int, seed: int) -> list[int]:
    """k of n indices drawn without replacement, in a seeded order (sets are stored sorted by label)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k].tolist()


def pick_unread(full: Any, k: int, seed: int, read: set[str]) -> list[int]:
    """Up to k ids of `full` (a TextSet) in `pick`'s seeded order, passing over every copy of the texts
    `read` (a fit's or a judge's: bbc-news repeats some articles, within and across its splits)."""
    order = pick(len(full), len(full), seed)
    return order[:k] if not read else [i for i in order if full.texts[i] not in read][:k]


def label_ids(task_set: Any, token_level: bool, max_classes: int) -> tuple[dict[str, int], list[str]]:
    """Tag -> class id for the probed classes, and class names by id."""
    if not token_level:
        return {}, list(task_set.label_names)
    counts: dict[str, int] = {}
    for tags in task_set.labels:
        for tag in tags:
            counts[tag] = counts.get(tag, 0) + 1
    top = sorted(counts, key=lambda t: (-counts[t], t))[:max_classes]
    return {t: i for i, t in enumerate(top)}, top


def label_of(task_set: Any, i: int, token_level: bool) -> Any:
    """Document i's label as a class id (str topics -> index in label_names); tag lists as they are."""
    label = task_set.labels[i]
    return label if token_level else task_set.label_names.index(label) if isinstance(label, str) else int(label)


# ---- activations ---------------------------------------------------------------------------

class Probed(NamedTuple):
    """What the probes see, one row per probed unit (a document, or a labelled token)."""

    x: Tensor
    """`(M, d)` site activations (document means, or tokens)"""
    z: Mapping[str, Tensor]
    """set name -> `(M, n)` concept activations (document means of per-token activations, or per token:
    then a `TokenColumns`, read when asked)"""
    y: Tensor
    """`(M,)` labels"""
    doc: Tensor
    """`(M,)` the document each row comes from: what the bootstrap resamples"""


@torch.no_grad()
def collect(lens: AttachedModel, site: str, encoders: Mapping[str, ConceptEncoder | Callable[[Tensor], Tensor]],
            batches: Iterable[tuple[dict[str, Tensor], Tensor]],
            on_tokens: Callable[[Tensor, Tensor], None] | None = None) -> Probed:
    """Activations at `site` of every batch -> probe rows for every set in `encoders` (ConceptEncoders,
    or plain `(N, d) -> (N, n)` readers such as `readings.probe_readers`'; the same reader under several
    names is read once); `on_tokens(x, doc)` also sees every token (`(N, d)` rows and their document ids).
    Documents are pooled batch by batch; token rows keep only their site activations (`TokenColumns`)."""
    read: dict[str, Callable[[Tensor], Tensor]] = {
        name: enc.encode if isinstance(enc, ConceptEncoder) else enc for name, enc in encoders.items()}
    xs, ys, docs, token_rows = [], [], [], []
    zs: dict[str, list[Tensor]] = {name: [] for name in encoders}
    device = input_device(lens.model)
    offset = 0
    with lens.capture(site) as cap:
        for batch, labels in batches:
            acts, meta = cap.forward(**{k: v.to(device) for k, v in batch.items()})
            x = acts[site].flatten(1).cpu()
            inner = (meta.position > 0).cpu()  # the first token is an attention sink
            x, rows = x[inner], meta.row.cpu()[inner]
            if on_tokens is not None and len(x):
                on_tokens(x, rows + offset)
            if labels.ndim == 1:  # one label per document: mean over its tokens
                part = pool_documents(read, x, rows, labels)
                part = part._replace(doc=part.doc + offset)
                for name in read:
                    zs[name].append(part.z[name])
            else:
                y = labels[meta.keep.cpu()][inner]
                x, rows, y = x[y >= 0], rows[y >= 0], y[y >= 0]
                part = Probed(x, {}, y, rows + offset)
                token_rows.append(x)
            xs.append(part.x)
            ys.append(part.y)
            docs.append(part.doc)
            offset += len(labels)
            release()  # each batch's codes are large temporaries; only their document means stay
    if token_rows and len(token_rows) < len(xs):
        raise ValueError("collect takes batches labelled per document or per token, not both")
    z = TokenColumns(read, token_rows) if token_rows else _joined(read, zs)
    return Probed(torch.cat(xs), z, torch.cat(ys), torch.cat(docs))


def _joined(read: Mapping[str, Callable[[Tensor], Tensor]], zs: Mapping[str, list[Tensor]]) -> dict[str, Tensor]:
    """Every column's batches concatenated, once per distinct reader (names sharing a reader share the tensor)."""
    done: dict[int, Tensor] = {}
    for name, f in read.items():
        if id(f) not in done:
            done[id(f)] = torch.cat(zs[name])
    return {name: done[id(f)] for name, f in read.items()}


class TokenColumns(Mapping[str, Tensor]):
    """Per-token probe columns, read when asked: column -> its reader applied batch by batch to the
    kept token rows. Token-level tasks keep these instead of every `(N, n)` column (tokens x width x
    columns would not fit); `blocks(name)` gives a column one batch at a time, as `collect` read it."""

    def __init__(self, readers: Mapping[str, Callable[[Tensor], Tensor]], rows: list[Tensor]):
        self.readers = dict(readers)
        self.rows = rows
        """the `(N_b, d)` labelled token rows of each batch"""

    def blocks(self, name: str) -> Iterator[Tensor]:
        """Column `name` as `(N_b, n)` row blocks, one per batch."""
        f = self.readers[name]
        for x in self.rows:
            with torch.no_grad():
                z = f(x)
            yield z

    def __getitem__(self, name: str) -> Tensor:
        return torch.cat(list(self.blocks(name)))

    def __contains__(self, name: object) -> bool:
        return name in self.readers  # (Mapping's would read the column)

    def __iter__(self) -> Iterator[str]:
        return iter(self.readers)

    def __len__(self) -> int:
        return len(self.readers)


class Derived:
    """A reader that is `then` of another reader's output, `then(base(x))`: `pool_documents` reads
    `base` once for both (a dense control's code reading is the one-hot largest of the cosines its
    activation reading gives, `readings.control_reader`), so the product is computed once, exactly."""

    def __init__(self, base: Callable[[Tensor], Tensor], then: Callable[[Tensor], Tensor]):
        self.base, self.then = base, then

    def __call__(self, x: Tensor) -> Tensor:
        return self.then(self.base(x))


def pool_documents(readers: Mapping[str, Callable[[Tensor], Tensor]], x: Tensor, doc: Tensor, y: Tensor) -> Probed:
    """Token rows `x` `(N, d)` of documents `doc` `(N,)` (ids into the labels `y` `(D,)`) -> one row per
    document with tokens: its mean site activation and the mean of every reader's `(N, n)` output
    (each token read, then pooled, as SAEBench mean-pools latent activations). A reader under several
    names is read once, and a `Derived` reader's base once for it and for the base's own column: the
    readers are grouped by what they read, and each group's `(N, n)` output is dropped once pooled."""
    count = torch.bincount(doc, minlength=len(y))
    has = count > 0
    groups: dict[int, tuple[Callable[[Tensor], Tensor], dict[int, Callable[[Tensor], Tensor]]]] = {}
    for f in readers.values():
        base = f.base if isinstance(f, Derived) else f
        groups.setdefault(id(base), (base, {}))[1][id(f)] = f
    pooled: dict[int, Tensor] = {}
    for base, members in groups.values():
        read = base(x)
        for key, f in members.items():
            pooled[key] = _doc_means(f.then(read) if isinstance(f, Derived) else read, doc, count)[has]
        del read
    z = {name: pooled[id(f)] for name, f in readers.items()}
    return Probed(_doc_means(x, doc, count)[has], z, y[has], torch.arange(len(y))[has])


def _doc_means(v: Tensor, rows: Tensor, count: Tensor) -> Tensor:
    return torch.zeros(len(count), v.shape[1]).index_add_(0, rows, v.float()) / count.clamp_min(1)[:, None]
