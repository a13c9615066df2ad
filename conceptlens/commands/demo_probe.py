"""The demo's probe table: per topic, each set's k-sparse probe against matched random directions.

    train, test = probe_rows(lens, tok, site, n_train=240, n_test=444, max_length=64)
    lines = topic_lines(train, test, sets, class_names, k=5, draws=5)
    print(format_topics(lines)); print(summary(lines))

SAEBench's k-sparse probe (`evaluate.probing`) on one balanced one-vs-rest task per bbc-news
topic: the k concepts with the largest mean difference on the train-split documents, a logistic
regression on them, its accuracy on held-out test-split documents (bootstrap interval over
those documents). The control has as many candidate directions as the set has concepts, drawn
at random `draws` times and read the way the set's concepts are read (`control_reader`); its
interval pools the draws and the document replicates (`bootstrap_draws`). Site activations are
captured once per token and every set is read from them, so adding sets costs no model pass.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from conceptlens.evaluate.bootstrap import bootstrap, bootstrap_draws
from conceptlens.evaluate.lines import Line, verdict


class Rows(NamedTuple):
    x: Tensor
    """`(N, d)` site activations of every kept token (the attention sink left out)"""
    doc: Tensor
    """`(N,)` each token's document"""
    y: Tensor
    """`(D,)` each document's class id"""


def probe_rows(lens: Any, tok: Any, site: str, split: str, n: int, max_length: int, seed: int,
               batch_size: int = 16) -> Rows:
    """Token activations at `site` of `n` bbc-news documents of `split` (a seeded draw)."""
    from conceptlens import data
    from conceptlens.evaluate import activations as act

    full = data.load("bbc-news", split)
    picked = act.pick(len(full), n, seed)
    texts = [full.texts[i] for i in picked]
    labels = [act.label_of(full, i, False) for i in picked]
    xs, docs = [], []

    def keep(x: Tensor, doc: Tensor) -> None:
        xs.append(x.float())
        docs.append(doc)

    act.collect(lens, site, {}, act.task_batches(tok, texts, labels, token_level=False, tag_ids={},
                                                 batch_size=batch_size, max_length=max_length), keep)
    return Rows(torch.cat(xs), torch.cat(docs), torch.tensor(labels))


def doc_means(z: Tensor, doc: Tensor, n_docs: int) -> Tensor:
    """`(n_docs, n)` mean of the rows `z` `(N, n)` of each document."""
    total = torch.zeros(n_docs, z.shape[1], dtype=torch.float64).index_add_(0, doc, z.double())
    return (total / torch.bincount(doc, minlength=n_docs).clamp_min(1)[:, None]).float()


def doc_max(z: Tensor, doc: Tensor, n_docs: int) -> Tensor:
    """`(n_docs, n)` largest value of each column over the rows `z` `(N, n)` of each document (0 without rows)."""
    out = torch.full((n_docs, z.shape[1]), -torch.inf).scatter_reduce_(0, doc[:, None].expand_as(z), z.float(), "amax")
    return torch.where(torch.isinf(out), 0.0, out)


POOLS = {"mean": doc_means, "max": doc_max}
"""How a document's token activations become its one probe row (the same for a set and its control)."""


Reader = Callable[[Tensor], Tensor]

READINGS = ("activation", "code")
"""How the probe reads a set and its control (`set_reader`, `control_reader`): "activation" is the
suite's definition (`concept_encoder`: an SAE's code; the cosine to the centred direction for
dense sets), its control the linear reading of random directions; "code" reads every set by its
nonlinear code, its control through the same nonlinearity: an SAE's TopK code against a random
TopK encoder (same width, k and decoder bias), a dense set's assigned concept (one-hot; nearest
centre for k-means, largest cosine otherwise, `describe.activations`) against the random
direction of largest cosine."""


READ_NOTE = {"activation": "concepts read by their activations (an SAE's code, a dense concept's cosine), "
                           "random directions by projection or cosine",
             "code": "concepts read by their codes (an SAE's TopK code, a dense set's assigned concept), random "
                     "directions through the same nonlinearity (a random TopK encoder, the largest cosine)"}


def _check_reading(reading: str) -> None:
    if reading not in READINGS:
        raise ValueError(f"unknown probe reading {reading!r}; choose one of {', '.join(READINGS)}")


def set_reader(cs: Any, reading: str = "activation") -> Reader:
    """`cs`'s concepts as the probe reads them (see `READINGS`)."""
    import torch.nn.functional as F

    from conceptlens.concepts.sae.restore import CLASSES
    from conceptlens.describe.activations import concept_activations
    from conceptlens.evaluate.activations import concept_encoder

    _check_reading(reading)
    if reading == "activation" or cs.method in CLASSES:
        return concept_encoder(cs).encode
    act = concept_activations(cs)
    assign = act.assign_fn
    if assign is None:
        raise ValueError(f"a {cs.method!r} set assigns no concept to a token; read it with reading='activation'")
    return lambda x: F.one_hot(assign(act.encode(x.float()), x.float()), len(cs)).float()


def control_reader(cs: Any, n: int, seed: int, reading: str = "activation") -> Reader:
    """`n` random directions of the site read as `cs`'s concepts are. "activation": by the cosine to
    the direction centred on the set's mean for dense sets (`describe.activations`), by the
    projection on unit directions for sets with their own encoder (SAEs), as the suite does.
    "code": through the set's nonlinearity (see `READINGS`)."""
    import torch.nn.functional as F

    from conceptlens.concepts.conceptset import ConceptSet
    from conceptlens.concepts.sae.restore import CLASSES
    from conceptlens.concepts.sae.topk import topk_relu
    from conceptlens.evaluate.activations import concept_encoder
    from conceptlens.evaluate.probing import random_directions

    _check_reading(reading)
    directions = random_directions(n, cs.d, seed)
    if reading == "code" and cs.method in CLASSES:
        b_dec = cs.encoder["b_dec"].float()
        k = cs.config.get("k")
        if k is None:
            return lambda x: torch.relu((x.float() - b_dec) @ directions.T)
        return lambda x: topk_relu((x.float() - b_dec) @ directions.T, min(int(k), n))
    if cs.mean is None:
        linear: Reader = lambda x: x @ directions.T
    else:
        randoms = ConceptSet(directions, cs.site, method="random", mean=cs.mean, config={"centred": True})
        linear = concept_encoder(randoms).encode
    if reading == "code":
        return lambda x: F.one_hot(linear(x).argmax(1), n).float()
    return linear


def _per_topic(read: Reader, train: Rows, test: Rows, tasks: list, k: int, pool: str) -> list[Tensor]:
    """Per task, `(test docs, 2)` (correct, count) of the k-sparse probe on `read`'s pooled documents."""
    from conceptlens.evaluate.probing import sparse_probe_accuracy

    z_train = POOLS[pool](read(train.x), train.doc, len(train.y))
    z_test = POOLS[pool](read(test.x), test.doc, len(test.y))
    docs = torch.arange(len(test.y))
    return [sparse_probe_accuracy(z_train, z_test, [t], k, docs, len(test.y)) for t in tasks]


def _ceiling(train: Rows, test: Rows, tasks: list, pool: str) -> list[Tensor]:
    """Per task, `(test docs, 2)` (correct, count) of the supervised ceiling: a logistic probe on every
    coordinate of the pooled site activations (`evaluate.probing.fit_logistic`)."""
    from conceptlens.evaluate.bootstrap import per_document
    from conceptlens.evaluate.probing import fit_logistic

    x_train = POOLS[pool](train.x, train.doc, len(train.y))
    x_test = POOLS[pool](test.x, test.doc, len(test.y))
    out = []
    for t in tasks:
        pred = torch.from_numpy(fit_logistic(x_train[t.train], t.y_train).predict(x_test[t.test].double().numpy()))
        rows = torch.stack([(pred == t.y_test).double(), torch.ones(len(pred), dtype=torch.float64)], 1)
        out.append(per_document(rows, t.test, len(test.y)))
    return out


def topic_lines(train: Rows, test: Rows, sets: dict[str, Any], class_names: list[str], *, k: int = 5,
                draws: int = 5, seed: int = 0, pool: str = "mean", reading: str = "activation") -> list[Line]:
    """One line per (set, topic): the set's k-sparse probe accuracy next to its matched control and
    the supervised ceiling (`_ceiling`), documents pooled by `pool` (a key of `POOLS`) for all, set
    and control read by `reading` (one of `READINGS`)."""
    if pool not in POOLS:
        raise ValueError(f"unknown pooling {pool!r}; choose one of {', '.join(POOLS)}")
    _check_reading(reading)
    from conceptlens.evaluate.probing import binary_tasks, mean_accuracy

    tasks = binary_tasks(train.y, test.y, class_names, seed)
    ceilings = [bootstrap(c, mean_accuracy, seed=seed) for c in _ceiling(train, test, tasks, pool)]
    lines = []
    for name, cs in sets.items():
        ours = _per_topic(set_reader(cs, reading), train, test, tasks, k, pool)
        controls = [_per_topic(control_reader(cs, len(cs), seed + 1 + r, reading), train, test, tasks, k, pool)
                    for r in range(draws)]
        for i, t in enumerate(tasks):
            control = bootstrap_draws([c[i] for c in controls], mean_accuracy, seed=seed)
            lines.append(Line(name, f"{t.name} k={k} accuracy", bootstrap(ours[i], mean_accuracy, seed=seed),
                              [(f"random {len(cs)} dirs x{draws}", control), (CEILING, ceilings[i])],
                              f"{len(t.test)} test documents"))
    return lines


CEILING = "full probe, all coordinates"


def format_topics(lines: list[Line]) -> str:
    """Topics down, sets across: `value [interval]` over the control's, and the verdict; then the
    topic's supervised ceiling, once."""
    sets = list(dict.fromkeys(ln.extractor for ln in lines))
    topics = list(dict.fromkeys(ln.metric for ln in lines))
    cell = {(ln.extractor, ln.metric): ln for ln in lines}
    width = 34
    out = [f"{'':<24}" + "".join(f"{s:>{width}}" for s in sets)]
    for topic in topics:
        ours, control = f"  {topic:<22}", f"  {'  matched random':<22}"
        for s in sets:
            ln = cell.get((s, topic))
            if ln is None:
                ours, control = ours + " " * width, control + " " * width
                continue
            v, c = ln.value, ln.baselines[0][1]
            ours += f"{f'{v.value:.3f} [{v.low:.3f}, {v.high:.3f}] {verdict(ln)}':>{width}}"
            control += f"{f'{c.value:.3f} [{c.low:.3f}, {c.high:.3f}]':>{width}}"
        out += [ours, control]
        ceiling = next((dict(ln.baselines).get(CEILING) for ln in lines if ln.metric == topic), None)
        if ceiling is not None:
            out.append(f"  {'  ceiling (full probe)':<22}"
                       f"{f'{ceiling.value:.3f} [{ceiling.low:.3f}, {ceiling.high:.3f}]':>{width}}")
    return "\n".join(out)


def summary(lines: list[Line]) -> str:
    """Plainly: which sets beat their matched control on every topic, outside the intervals, and which not."""
    out = []
    for name in dict.fromkeys(ln.extractor for ln in lines):
        mine = [ln for ln in lines if ln.extractor == name]
        short = [ln.metric.split(" ")[0] + f" ({verdict(ln)})" for ln in mine if verdict(ln) != "wins"]
        if not short:
            out.append(f"{name}: beats matched random directions on every topic, outside the intervals")
        else:
            out.append(f"{name}: does NOT beat matched random directions outside the intervals on "
                       f"{len(short)} of {len(mine)} topics: {', '.join(short)}")
            out.append(f"  room between the control's upper bound and the full probe's accuracy: {_room(mine)}")
    return "\n".join(out)


def _room(lines: list[Line]) -> str:
    """Per topic, the full probe's accuracy minus the control's upper bound: how much a k-sparse probe
    could at most gain over its control's interval if it reached the supervised ceiling."""
    cells = []
    for ln in lines:
        ceiling = dict(ln.baselines).get(CEILING)
        if ceiling is not None:
            cells.append(f"{ln.metric.split(' ')[0]} {ceiling.value - ln.baselines[0][1].high:+.3f}")
    return ", ".join(cells) or "no ceiling measured"


def diff_of_means(rows: Rows, label: int) -> Tensor:
    """The steering baseline from the probe's train rows (no model pass of its own): the mean document
    activation of `label`'s documents minus the others' (`evaluate.steering.diff_of_means`)."""
    from conceptlens.evaluate.activations import Probed
    from conceptlens.evaluate.steering import diff_of_means as of_probed

    docs = torch.arange(len(rows.y))
    return of_probed(Probed(doc_means(rows.x, rows.doc, len(rows.y)), {}, rows.y, docs), label)


def run_probes(lens: Any, tok: Any, sets: dict[str, Any], site: str, *, n_train: int, n_test: int,
               max_length: int, draws: int, seed: int, k: int = 5, pool: str = "mean",
               reading: str = "activation") -> tuple[list[Line], Rows]:
    """Capture the probe documents, print the per-topic table and its plain summary, then the summary
    of the other reading (`READINGS`, on the same rows); the lines and the train rows (which the
    demo's steering baseline reuses)."""
    from conceptlens import data

    names = list(data.load("bbc-news", "test").label_names)
    print(f"\nk = {k} sparse probe per topic (SAEBench's protocol) on held-out documents: concepts chosen and "
          f"probes fitted on {n_train} train-split articles, scored on {n_test} test-split articles (first "
          f"{max_length} tokens each, {pool}-pooled, balanced one-vs-rest); control: as many random directions as "
          f"the set has concepts, read and pooled the same way, {draws} draws; 95% bootstrap intervals over test "
          f"documents; {READ_NOTE[reading]}")
    train = probe_rows(lens, tok, site, "train", n_train, max_length, seed)
    test = probe_rows(lens, tok, site, "test", n_test, max_length, seed)
    lines = topic_lines(train, test, sets, names, k=k, draws=draws, seed=seed, pool=pool, reading=reading)
    print(format_topics(lines))
    print(summary(lines))
    other = next(r for r in READINGS if r != reading)
    print(f"The same probes, {READ_NOTE[other]} (--probe-read {other}):")
    print(summary(topic_lines(train, test, sets, names, k=k, draws=draws, seed=seed, pool=pool, reading=other)))
    return lines, train


def reconstruction(lens: Any, tok: Any, sets: dict[str, Any], docs: int, seed: int) -> list[Line]:
    """CE-loss recovered (and KL) of the sets that reconstruct, next to zero- and mean-ablation, printed."""
    from conceptlens.evaluate.activations import concept_encoder
    from conceptlens.evaluate.lines import format_lines
    from conceptlens.evaluate.suite import SuiteConfig, run_suite

    decoding = {name: cs for name, cs in sets.items() if concept_encoder(cs).decode is not None}
    if not decoding:
        return []
    lines = run_suite(lens, tok, decoding, SuiteConfig(suites=("reconstruction",), recon_docs=docs, seed=seed))
    keep = [ln for ln in lines if ln.metric in ("CE loss recovered", "KL to clean (nats/token)", "FVU")]
    print(f"\nReconstruction spliced in at the site on {docs} held-out test-split articles (95% bootstrap intervals):")
    print(format_lines(keep))
    return keep
