"""The description pass: held-out documents through the model once, every concept set described.

    descriptions = lens.describe({"topk": cs_topk, "km": cs_km}, "bbc-news", skip_documents=400,
                                 max_tokens=50_000, out="runs/demo/describe")
    descriptions["topk"].contexts[12]

It is a fit whose extractors are `ConceptDescriber`s (one forward feeds every set at every
site; the fit's filters, checkpoints and resume come with it), followed by `finish`.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.describe import finish as fin
from conceptlens.describe.describer import ConceptDescriber, DescribeConfig
from conceptlens.describe.description import Description
from conceptlens.describe.steering import SteeringRequest, steering_samples
from conceptlens.fit import FitConfig, fit_config
from conceptlens.interface import AttachedModel


CONTROL_METHODS = ("random",)
"""Sets described as baselines, not as concepts: the atlas shows them as control rows only."""


@dataclass
class FinishOptions:
    n_nearest: int = 8
    n_tokens: int = 10
    bins: int = 32


def describe(lens: AttachedModel, concept_sets: Mapping[str, ConceptSet], data: Any, *, tokenizer: Any = None,
             labels: Sequence[Any] | None = None, label_names: Sequence[str] | None = None,
             skip_documents: int = 0, top_n: int = 16, window: tuple[int, int] = (8, 4),
             out: str | None = None, steering: SteeringRequest | None = None, coact_rows: int = 512,
             options: FinishOptions | None = None, fit: FitConfig | None = None,
             **fit_options: Any) -> dict[str, Description]:
    """Describe every set over `data` after its first `skip_documents` documents; `labels`
    (one per document of the whole source; a TextSet brings its own) add per-class probes.
    `out`: the run's describe/ folder (checkpoint.pt and one <name>/ per set). The pass streams
    like a fit: `fit` (a FitConfig) and keyword overrides of its fields (`max_tokens`,
    `batch_size`, `max_length`, `checkpoint_every`, `resume`, `progress`, `filters`)."""
    from conceptlens import data as datasets
    from conceptlens.fit import fit as run_fit

    tokenizer = tokenizer or lens.tokenizer
    if isinstance(data, datasets.TextSet) and labels is None and data.labels and \
            not isinstance(data.labels[0], list):
        labels, label_names = data.labels, data.label_names
    classes = _class_ids(labels, label_names)
    n_docs = None
    if classes is not None:
        n_docs = len(classes[0]) - skip_documents
        if n_docs < 1:
            raise ValueError(f"skip_documents={skip_documents} leaves no labelled document of {len(classes[0])}")
    config = DescribeConfig(top_n=top_n, window=window, coact_rows=coact_rows, n_documents=n_docs)
    describers: dict[str, ConceptDescriber] = {}
    plan: dict[str, dict[str, ConceptDescriber]] = {}
    for name, cs in _checked(lens, concept_sets).items():  # the first describer of each site watches its norms
        describers[name] = d = ConceptDescriber(cs, config, first_document=skip_documents,
                                                watch_norms=_site(cs) not in plan)
        plan.setdefault(_site(cs), {})[name] = d
    steered = steering.chosen({name: d.n for name, d in describers.items()}) if steering is not None else {}
    if steered and not getattr(lens.model, "can_generate", lambda: False)():
        warnings.warn(f"no steering samples: {type(lens.model).__name__} does not generate text (an encoder), so "
                      f"steering {', '.join(f'{n}:{i}' for n, ids in steered.items() for i in ids)} is left out", stacklevel=2)
    texts = islice(datasets.iter_texts(data), skip_documents, None)
    # a fit's own budgets per extractor (`extractor_tokens`) are not this pass's; given here, they are
    streaming = fit_config(fit, "describe", checkpoint_dir=out, **{"extractor_tokens": {}, **fit_options})
    digests = {name: d.concepts.digest() for name, d in describers.items()}
    if out is not None:  # a pass of other documents, or of other sets (a fit that ran on), starts afresh
        _forget_other_pass(Path(out), {"skip_documents": skip_documents, "data": _source_id(data), "sets": digests},
                           streaming.max_tokens)
    filters = streaming.filters
    report = run_fit(lens, plan, texts, tokenizer=tokenizer, config=streaming)
    options = options or FinishOptions()
    results = {}
    known: dict[int, str] = {}  # token texts decoded for one set, reused by the next
    heads: dict[int, fin.Unembedding] = {}  # the unembedding prepared for one set, reused by the next
    for name, d in describers.items():
        results[name] = finish(d, name=name, lens=lens, tokenizer=tokenizer,
                               classes=None if classes is None else (classes[0][skip_documents:], classes[1]),
                               options=options, known=known, heads=heads)
        results[name].info["set_sha256"] = digests[name]  # the set described: the atlas refuses another
        site = _site(d.concepts)
        watch = next(w.norms for w in plan[site].values() if w.norms is not None)
        results[name].info["norms"] = {**watch.summary(lambda ids: fin.whole(tokenizer, ids, known)),
                                       "filtered": report.rows.get(site, {}), "filter_ratio": filters.max_norm_ratio}
        if steering is not None:
            results[name].info["steering"] = steering_samples(lens, tokenizer, d.concepts, name,
                                                              steered.get(name, []), steering)
        if out is not None:
            results[name].save(Path(out) / name)
    return results


def _source_id(data: Any) -> str | None:
    """What names the documents of a pass: a path or set name as given; a bundled set's name, split and
    the digest of its documents in their order (another split or shuffle is another pass)."""
    from conceptlens import data as datasets

    if isinstance(data, str):
        return data
    if isinstance(data, datasets.TextSet):
        import hashlib

        digest = hashlib.sha256()
        for text in data.texts:
            digest.update(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest())
        return f"{data.name}:{data.split}:{digest.hexdigest()[:16]}"
    return getattr(data, "name", None)


def _forget_other_pass(out: Path, source: dict[str, Any], max_tokens: int | None) -> None:
    """A checkpoint of a pass over other documents (e.g. before the fit ran longer) or of other sets
    (refitted since) is dropped: the fit's fingerprint cannot see which documents an iterator skipped,
    nor a set's directions (its describers have the same shapes); so is one of a pass past
    `max_tokens` (an interrupted longer pass), which a fit would refuse to resume."""
    import json

    from conceptlens._io import atomic_write
    from conceptlens.checkpoint import check_budget
    from conceptlens.fit import CHECKPOINT

    marker, checkpoint = out / "source.json", out / CHECKPOINT
    recorded = _recorded_source(marker) if marker.is_file() else source
    if not isinstance(recorded, dict):
        recorded = {}  # a marker that does not read names no pass: the pass starts afresh
    sets = source.get("sets", {})
    was = recorded.get("sets", sets)
    refitted = isinstance(was, dict) and was.keys() == sets.keys() and was != sets  # other sets' names: refused
    if ({k: v for k, v in recorded.items() if k != "sets"} != {k: v for k, v in source.items() if k != "sets"}
            or refitted) and checkpoint.is_file():
        checkpoint.unlink()
    try:
        check_budget(checkpoint, max_tokens)
    except ValueError:
        checkpoint.unlink()  # the pass starts afresh on the budget now given
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(source)
    atomic_write(marker, lambda p: Path(p).write_text(text))


def _recorded_source(marker: Path) -> Any:
    """The pass `source.json` records; None when it does not read (empty, cut short, not JSON)."""
    import json

    try:
        return json.loads(marker.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None


def _site(cs: ConceptSet) -> str:
    """The site of a checked set (`_checked` refuses sets without one)."""
    if cs.site is None:
        raise ValueError(f"{cs!r} names no site; set cs.site")
    return cs.site


def _checked(lens: AttachedModel, concept_sets: Mapping[str, ConceptSet]) -> dict[str, ConceptSet]:
    if not concept_sets:
        raise ValueError("describe needs at least one concept set: {name: ConceptSet}")
    out = {}
    for name, cs in concept_sets.items():
        if not isinstance(cs, ConceptSet):
            raise TypeError(f"concept set {name!r} is a {type(cs).__name__}, not a ConceptSet")
        if cs.site is None:
            raise ValueError(f"concept set {name!r} names no site; set cs.site")
        site = lens.site(cs.site)
        width = math.prod(int(s) for s in site.shape[2:])
        if width != cs.d:
            raise ValueError(f"concept set {name!r} has width {cs.d} but {site.name} has width {width}")
        if cs.site != site.name:  # the same set (its mean, encoder, stats and all) under the site's own name
            cs = copy.copy(cs)
            cs.site = site.name
        out[name] = cs
    return out


def _class_ids(labels: Sequence[Any] | None, names: Sequence[str] | None) -> tuple[list[int], list[str]] | None:
    """Labels -> (class id per document, class names); str labels are numbered by `names` (or sorted)."""
    if labels is None:
        return None
    labels = list(labels)
    if names is None:
        names = sorted({str(v) for v in labels}) if labels and isinstance(labels[0], str) else \
            [str(v) for v in sorted(set(labels))]
    names = list(names)
    if labels and isinstance(labels[0], str):
        unknown = sorted(set(labels) - set(names))
        if unknown:
            raise ValueError(f"labels {unknown[:5]} are not among the label names {names}")
        return [names.index(v) for v in labels], names
    ids = [int(v) for v in labels]
    if min(ids) < 0 or max(ids) >= len(names):
        raise ValueError(f"integer labels must lie in 0..{len(names) - 1} (one per label name); got "
                         f"{min(ids)}..{max(ids)}")
    return ids, names


def unembedding(lens: AttachedModel, site: str, width: int) -> torch.Tensor | None:
    """The decoder's output embedding `(V, d)` when the site lives in its residual stream's basis, else
    None: a per-head site (attn.q/k/v/z, H * d_head wide, often d_model) or the MLP's hidden layer is
    in another basis, where dot products with the unembedding mean nothing."""
    shape = lens.site(site).shape
    if len(shape) != 3 or site.endswith("mlp.post"):  # (B, T, H, d_head), or the MLP's own basis
        return None
    model = lens.model
    get_head = getattr(model, "get_output_embeddings", None)  # a transformers model's
    head = get_head() if callable(get_head) else None
    can_generate = getattr(model, "can_generate", lambda: False)()
    if head is None or not can_generate or site.startswith("encoder.") or head.weight.shape[1] != width:
        return None
    return head.weight.detach()


def finish(d: ConceptDescriber, *, name: str, lens: AttachedModel, tokenizer: Any,
           classes: tuple[list[int], list[str]] | None = None, options: FinishOptions | None = None,
           known: dict[int, str] | None = None, heads: dict[int, fin.Unembedding] | None = None) -> Description:
    """The Description of one describer's state (see ATLAS_FORMAT.md); `known`: token texts decoded
    before with this tokenizer (see `finish.decoder`), `heads`: the model's unembedding prepared
    before, by width (see `finish.Unembedding`); both filled here."""
    o, cs, n = options or FinishOptions(), d.concepts, d.n
    if d.sums is None:
        raise ValueError(f"concept set {name!r} saw no tokens: nothing to describe (more data or a smaller "
                         "skip_documents?)")
    s = {k: v.cpu() for k, v in d.sums.items()}
    rows = max(d.rows, 1)
    edges, counts = fin.display_histogram(s["hist"], s["zeros"], o.bins)
    top_values, top_doc, top_pos = fin.used_slots(d)
    stats = {"frequency": (s["fire_count"].double() / rows).float(), "mean_activation": (s["act_sum"] / rows).float(),
             **({} if d.activations.sparse else {"assigned": (s["assign_count"].double() / rows).float()}),
             "max_activation": d.top.values[:, 0].cpu().float(), "hist_edges": edges, "hist_counts": counts,
             "top_values": top_values, "top_doc": top_doc, "top_pos": top_pos,
             "map_xy": fin.map_xy(d.activations.directions)}
    unit = d.activations.directions
    stats["nearest_direction"], stats["nearest_direction_cos"] = fin.nearest_direction(unit, o.n_nearest)
    stats["nearest_coact"], stats["nearest_coact_score"] = fin.nearest_coactive(s, d.activations.sparse,
                                                                                o.n_nearest)
    w_u = unembedding(lens, _site(cs), cs.d)
    tokens = None
    if w_u is not None:
        heads = heads if heads is not None else {}
        head = heads[cs.d] if cs.d in heads else heads.setdefault(cs.d, fin.Unembedding(w_u))  # one copy per pass
        stats |= fin.logit_tokens(unit, head, min(o.n_tokens, w_u.shape[0]))
        shown = torch.cat([stats["promoted_ids"], stats["suppressed_ids"]]).view(-1)
        vocab = fin.whole(tokenizer, torch.bincount(shown).nonzero().squeeze(1).tolist(), known)  # unique, no sort
        tokens = {k: [[vocab[i] for i in row] for row in stats[f"{k}_ids"].tolist()] for k in ("promoted", "suppressed")}
    entropy = None
    if classes is not None:
        stats["probe_loss"], h = fin.class_probes(s["doc_sum"], s["doc_rows"], classes[0], len(classes[1]))
        entropy = {c: (None if math.isnan(v) else v) for c, v in zip(classes[1], h.tolist())}
    contexts = fin.decode_contexts(d, tokenizer, known)
    info = {"name": name, "site": cs.site, "method": cs.method, "model": cs.model or lens.name, "n_concepts": n,
            "tokens": d.rows, "documents": d.documents, "first_document": d.first_document, "top_n": d.top.k,
            "window": list(d.top.window), "hist_edges_kind": "per-concept", "activation": d.activations.kind,
            "sparse": d.activations.sparse, "control": cs.method in CONTROL_METHODS,
            "coact_kind": "jaccard" if d.activations.sparse else "pearson",
            "mean_token_norm": float(s["norm_sum"]) / rows, "labels": None if classes is None else list(classes[1]),
            "base_rate_entropy": entropy, "has_unembedding": w_u is not None, "steering": []}
    return Description(info, stats, contexts, tokens)
