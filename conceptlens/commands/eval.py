"""`conceptlens eval RUN_DIR --task TASK`: a table of quality metrics for a fitted concept set.

    conceptlens eval runs/demo --task bbc-news          # a fit checkpoint_dir (holds concepts/<name>/)
    conceptlens eval runs/demo/concepts/blocks.15.resid_out --task wsj-pos

Concept activations: an SAE set's own encoder (rebuilt with `sae_from_concept_set`), a VQ
codebook's one-hot nearest code (it reconstructs), otherwise the atlas's definition
(`describe.activations`: the cosine to the centred direction). Documents of
bbc-news / movie-polarity are probed as wholes: their concept activations are averaged over
their real tokens. wsj-pos is probed per token: each word's Penn tag labels its first
sub-token (found through the tokenizer's character offsets); the other sub-tokens go
unlabelled, and only the `--max-classes` most frequent tags are probed. Each sequence's first
token, the attention sink, is always left out (as fits leave it out).

Rows (`eval_table.metric_rows`), each next to its baseline: probe loss (test log-loss of the best single concept per
class, one-vs-rest, among `--probe-candidates` concepts per class screened by standardised
mean difference), effective rank and max pairwise cosine of the directions, FVU / L0 / dead
fraction on test tokens and CE-loss recovered (sets that reconstruct), and per class the
cosine between the shrunk-LDA direction of the train split and its best-aligned concept.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from conceptlens.batching import check_max_length, encode_batch
from conceptlens.commands._args import count, existing_dir, positive_int, seed
from conceptlens.commands.eval_table import Features, ReconStats, Row, format_rows, metric_rows
from conceptlens.concepts.conceptset import CONFIG_FILE, ConceptSet

TASKS = ("bbc-news", "movie-polarity", "wsj-pos")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=existing_dir,
                        help="a ConceptSet folder, or a fit checkpoint_dir holding concepts/<name>/")
    parser.add_argument("--task", required=True, choices=TASKS, help="labelled set to probe with")
    parser.add_argument("--concepts", help="which concepts/<name> of a checkpoint_dir holding several")
    parser.add_argument("--model", help="model to load (default: the one the set names)")
    parser.add_argument("--max-docs", type=positive_int, default=400, help="documents (sentences) per split")
    parser.add_argument("--max-length", type=positive_int, default=128, help="tokens per document")
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--max-classes", type=positive_int, default=8,
                        help="wsj-pos: probe the most frequent tags only")
    parser.add_argument("--probe-candidates", type=count, default=16,
                        help="concepts per class screened for the logistic probe (0: probe every concept)")
    parser.add_argument("--ce-docs", type=count, default=16, help="test documents for CE-loss recovered (0: skip)")
    parser.add_argument("--seed", type=seed, default=0, help="which documents are drawn")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


# ---- concept sets and their activations ----------------------------------------------------

def load_concepts(run_dir: str | Path, name: str | None = None) -> ConceptSet:
    """The ConceptSet in `run_dir`, or in `run_dir/concepts/<name>` (the only one if `name` is None)."""
    root = Path(run_dir)
    if (root / CONFIG_FILE).is_file():
        return ConceptSet.load(root)
    found = sorted(p.name for p in (root / "concepts").glob("*") if (p / CONFIG_FILE).is_file())
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
    """The set's own encoder when it carries one (SAE, VQ codebook), else `concept_activations`."""
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

    act = concept_activations(cs)  # the atlas's definition: cosine to the centred direction
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


# ---- activations ---------------------------------------------------------------------------

@torch.no_grad()
def collect(lens: Any, site: str, encoder: ConceptEncoder, batches: Iterable[tuple[dict[str, Tensor], Tensor]],
            recon: ReconStats | None = None) -> Features:
    """Activations at `site` of every batch -> probe features; `recon` also sees every token."""
    xs, zs, ys = [], [], []
    device = next(lens.model.parameters()).device
    with lens.capture(site) as cap:
        for batch, labels in batches:
            x = cap.forward(**{k: v.to(device) for k, v in batch.items()})[site].flatten(1).cpu()
            meta = cap.last[1]
            inner = (meta.position > 0).cpu()  # the first token is an attention sink
            x, z = x[inner], encoder.encode(x[inner])
            if recon is not None and encoder.decode is not None and len(x):
                recon.update(x, z, encoder.decode(z))
            if labels.ndim == 1:  # one label per document: mean over its tokens
                rows = meta.row.cpu()[inner]
                count = torch.bincount(rows, minlength=len(labels))
                has = count > 0
                xs.append((torch.zeros(len(labels), x.shape[1]).index_add_(0, rows, x) / count[:, None])[has])
                zs.append((torch.zeros(len(labels), z.shape[1]).index_add_(0, rows, z) / count[:, None])[has])
                ys.append(labels[has])
            else:
                y = labels[meta.keep.cpu()][inner]
                xs.append(x[y >= 0])
                zs.append(z[y >= 0])
                ys.append(y[y >= 0])
    return Features(torch.cat(xs), torch.cat(zs), torch.cat(ys))


# ---- the command ---------------------------------------------------------------------------

def _pick(n: int, k: int, seed: int) -> list[int]:
    """k of n indices drawn without replacement, in a seeded order (sets are stored sorted by label)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k].tolist()


def _label_ids(task_set: Any, token_level: bool, max_classes: int) -> tuple[dict[str, int], list[str]]:
    """Tag -> class id for the probed classes, and class names by id."""
    if not token_level:
        return {}, list(task_set.label_names)
    counts: dict[str, int] = {}
    for tags in task_set.labels:
        for tag in tags:
            counts[tag] = counts.get(tag, 0) + 1
    top = sorted(counts, key=lambda t: (-counts[t], t))[:max_classes]
    return {t: i for i, t in enumerate(top)}, top


def _label(task_set: Any, i: int, token_level: bool) -> Any:
    """Document i's label as a class id (str topics -> index in label_names); tag lists as they are."""
    label = task_set.labels[i]
    return label if token_level else task_set.label_names.index(label) if isinstance(label, str) else int(label)


def run(args: argparse.Namespace) -> int:
    import conceptlens
    from conceptlens import data
    from conceptlens.commands._common import load_model
    from conceptlens.metrics.splice import splice_ce

    for name in ("max_docs", "max_length", "batch_size", "max_classes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer; got {getattr(args, name)}")
    for name in ("ce_docs", "probe_candidates"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0; got {getattr(args, name)}")
    cs = load_concepts(args.run_dir, args.concepts)
    if cs.site is None:
        raise ValueError(f"{cs} names no site; set cs.site and save it again")
    if not (args.model or cs.model):
        raise ValueError(f"{cs} names no model; pass --model")
    model, tok = load_model(args, args.model or cs.model)
    check_max_length(model, args.max_length, "--max-length")
    lens = conceptlens.attach(model, tok)
    site = lens.site(cs.site)
    width = math.prod(int(s) for s in site.shape[2:])
    if width != cs.hidden_size:
        raise ValueError(f"the concepts have width {cs.hidden_size} but {site.name} has width {width}")
    encoder, token_level = concept_encoder(cs), args.task == "wsj-pos"
    splits = {s: data.load(args.task, s) for s in ("train", "test")}
    picked = {s: _pick(len(t), args.max_docs, args.seed) for s, t in splits.items()}
    texts = {s: [splits[s].texts[i] for i in picked[s]] for s in splits}
    tag_ids, class_names = _label_ids(splits["train"], token_level, args.max_classes)
    labels = {s: [_label(t, i, token_level) for i in picked[s]] for s, t in splits.items()}
    batches = {s: _bar(task_batches(tok, texts[s], labels[s], token_level=token_level, tag_ids=tag_ids,
                                    batch_size=args.batch_size, max_length=args.max_length),
                       math.ceil(len(texts[s]) / args.batch_size), f"{s} activations", args.no_progress)
               for s in splits}
    recon = ReconStats() if encoder.decode is not None else None
    train = collect(lens, site.name, encoder, batches["train"])
    test = collect(lens, site.name, encoder, batches["test"], recon)
    rows = metric_rows(cs.directions, train, test, class_names, recon, args.probe_candidates or None)
    if encoder.decode is not None and args.ce_docs and model.can_generate() and not model.config.is_encoder_decoder:
        docs = texts["test"][:args.ce_docs]
        ce_batches = [encode_batch(tok, docs[i:i + args.batch_size], args.max_length)
                      for i in range(0, len(docs), args.batch_size)]
        ce = splice_ce(lens, site.name, lambda x: encoder.decode(encoder.encode(x)),
                       _bar(ce_batches, len(ce_batches), "CE loss recovered", args.no_progress))
        rows.append(Row("CE loss recovered", ce.recovered, f"clean {ce.clean:.3f}, spliced {ce.spliced:.3f}, "
                                                           f"zero {ce.zero_ablated:.3f} nats over {ce.tokens:,} tokens",
                        0.0, "site zeroed"))
    unit = "tokens (first sub-token of each word)" if token_level else "documents (mean over tokens)"
    print(f"{cs}\nconcept activations: {encoder.kind}\n{args.task}: {len(train.y):,} train / {len(test.y):,} test "
          f"{unit}, {len(class_names)} classes\n")
    print(format_rows(rows))
    for warning in baseline_warnings(rows):
        print(f"warning: {warning}")
    return 0


def baseline_warnings(rows: list[Row]) -> list[str]:
    """Figures that do no better than their baseline (lower is better for losses and FVU)."""
    lower_better = ("probe loss", "FVU")
    out, classes, worse = [], 0, 0
    in_probe = False
    for row in rows:
        if row.metric.startswith("probe loss"):
            in_probe = True
            continue
        if in_probe and row.metric.startswith("  "):
            classes, worse = classes + 1, worse + (row.value >= row.baseline)
            continue
        in_probe = False
        if row.metric.startswith(lower_better) and row.value >= row.baseline:
            out.append(f"{row.metric} {row.value:.4f} is no better than the {row.baseline_name} ({row.baseline:.4f})")
    if worse:
        out.insert(0, f"{worse} of {classes} classes' probes do no better than their base-rate entropy: those "
                      "concepts carry no information about the class")
    return out


def _bar(items: Iterable, total: int, desc: str, off: bool) -> Iterable:
    from tqdm.auto import tqdm

    return tqdm(items, total=total, desc=desc, unit="batch", disable=off, dynamic_ncols=True, leave=False)
