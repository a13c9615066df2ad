"""The evaluation suite: every part on every set of one site, as lines next to their baselines.

    config = SuiteConfig(suites=("reconstruction", "probing", "absorption"))
    lines = run_suite(lens, tok, {"topk": cs_topk, "kmeans": cs_kmeans}, config)
    print(format_lines(lines))

Parts: `reconstruction` (sets that reconstruct: SAEs, VQ), `probing` (k-sparse probing on the
labelled sets), `absorption` (first letters; sets that reconstruct) and `quality` (the older
table of `conceptlens eval --task`: best single concept's probe loss, geometry, LDA cosines) and
`steering` (AxBench-style steering toward every bbc-news topic and sentiment, `evaluate.steering`).
`synthetic` (ground-truth recovery on SAELens's generator, `synthetic.synthetic_lines`) needs no
model or run folder; `run_parts` leaves it to its caller.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import torch

from conceptlens.batching import encode_batch
from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.evaluate import activations as act
from conceptlens.evaluate.bootstrap import Estimate
from conceptlens.evaluate.lines import Line
from conceptlens.evaluate.probing import CONCEPT_TOP, KS, RANDOM_DRAWS
from conceptlens.evaluate.readings import READINGS, Reader, probe_readers
from conceptlens.interface import AttachedModel

SUITES = ("reconstruction", "probing", "absorption", "quality", "steering", "synthetic")
DEFAULT_SUITES = ("reconstruction", "probing", "absorption")
PROBE_TASKS = ("bbc-news", "movie-polarity", "wsj-pos", "conll2010-uncertainty")


@dataclass
class SuiteConfig:
    """What the suite runs and on how much text."""

    suites: tuple[str, ...] = DEFAULT_SUITES
    """parts to run, from `SUITES`"""
    tasks: tuple[str, ...] = PROBE_TASKS
    """labelled sets of the probing (and quality) part"""
    max_docs: int = 400
    """documents (sentences) drawn per split of each labelled set"""
    max_length: int = 128
    """tokens per document"""
    batch_size: int = 16
    max_classes: int = 8
    """wsj-pos: probe the most frequent tags only"""
    recon_data: str = "bbc-news"
    """labelled set whose test split is the held-out text of the reconstruction part (train: the site mean)"""
    recon_docs: int = 32
    """held-out documents of the reconstruction part"""
    absorption_words: int = 2000
    """vocabulary tokens of the absorption part (a fifth are its test words)"""
    ks: tuple[int, ...] = KS
    random_draws: int = RANDOM_DRAWS
    """draws of the random-direction control"""
    readings: tuple[str, ...] = READINGS
    """probing part: how sets and their controls are read (`readings`: "activation", "code")"""
    concept_top: int = CONCEPT_TOP
    """probing part: latents per task scored alone, for the atlas's concept pages (0: none)"""
    probe_candidates: int | None = 16
    """quality part: concepts per class screened for the single-concept probe (None: all)"""
    seed: int = 0
    fit_read: tuple[str, int | None, int] | None = None
    """(labelled set as `fit --data` names it, NAME or NAME:SPLIT, train by default; shuffle seed or
    None; documents): the documents a fit read (the first `documents` of that split, shuffled with the
    seed as `fit` reads a bundled set); probes neither learn nor are scored on them"""
    progress: bool = False

    def __post_init__(self) -> None:
        for name, valid in (("suites", SUITES), ("tasks", PROBE_TASKS), ("readings", READINGS)):
            bad = [v for v in getattr(self, name) if v not in valid]
            if bad or not getattr(self, name):
                raise ValueError(f"unknown {name} {bad or '(none)'}; choose from {', '.join(valid)}")
        for name in ("max_docs", "max_length", "batch_size", "max_classes", "recon_docs", "absorption_words",
                     "random_draws"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer; got {getattr(self, name)}")
        if self.concept_top < 0:
            raise ValueError(f"concept_top must be 0 or a positive integer; got {self.concept_top}")
        if not self.ks or min(self.ks) < 1:
            raise ValueError(f"ks must be positive integers; got {list(self.ks)}")


OWN_KEYS = {"reconstruction": ("recon_data", "recon_docs"), "absorption": ("absorption_words",),
            "probing": ("max_docs", "max_classes", "ks", "random_draws", "readings", "concept_top",
                        "probe_candidates")}
"""SuiteConfig fields only one kind of part reads ("probing" stands for the quality part too)."""


def part_config(config: SuiteConfig, part: str) -> dict[str, Any]:
    """The settings a part's figures depend on, as `eval.json` records them: a part run again with the
    same ones keeps the figures of the sets it did not run (the part names its task; other parts'
    own settings, the parts chosen and the progress bar do not count)."""
    kind = "probing" if part.split()[0] in ("probing", "quality") else part
    others = {key for k, keys in OWN_KEYS.items() if k != kind for key in keys}
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in {"suites", "tasks", "progress", *others}}


def run_suite(lens: AttachedModel, tok: Any, sets: Mapping[str, ConceptSet], config: SuiteConfig) -> list[Line]:
    """Every part of `config.suites` on `sets` (all at one site), in order."""
    return [line for _, lines in run_parts(lens, tok, sets, config) for line in lines]


def run_parts(lens: AttachedModel, tok: Any, sets: Mapping[str, ConceptSet], config: SuiteConfig) -> Iterator[tuple[str, list[Line]]]:
    """(part, lines) as each part of `config.suites` finishes: `run_suite` one part at a time."""
    sites = {cs.site for cs in sets.values()}
    only = next(iter(sites)) if len(sites) == 1 else None
    if only is None:
        raise ValueError(f"run_suite takes sets of one site; got sites {sorted(map(str, sites))}")
    site = lens.site(only).name
    encoders = {name: act.concept_encoder(cs) for name, cs in sets.items()}
    decoders = {name: enc for name, enc in encoders.items() if enc.decode is not None}
    for part in config.suites:
        if part == "reconstruction" and decoders:
            yield part, _reconstruction(lens, tok, site, decoders, config)
        elif part == "absorption" and decoders:
            from conceptlens.evaluate.absorption import absorption_lines, alpha_tokens

            words = alpha_tokens(tok, config.absorption_words, config.seed)
            yield part, absorption_lines(lens, site, decoders, tok, words, seed=config.seed)
        elif part == "steering":
            from conceptlens.evaluate.steering import SteeringConfig, steering_lines

            yield part, steering_lines(lens, tok, site, sets, SteeringConfig(max_length=config.max_length,
                                                                             batch_size=config.batch_size,
                                                                             seed=config.seed))
        elif part in ("probing", "quality"):
            for task in config.tasks:
                yield f"{part} {task}", _probing(lens, tok, site, encoders, sets, task, part, config)


def _read_texts(fit_read: tuple[str, int | None, int] | None, task: str) -> set[str]:
    """Texts of the `task` documents a fit read (`SuiteConfig.fit_read`): the first `documents` of its
    split in its shuffle (of any split: bbc-news:all or :test reads test articles too)."""
    from conceptlens import data

    name, _, split = fit_read[0].partition(":") if fit_read is not None else ("", "", "")
    if fit_read is None or name != task:
        return set()
    _, shuffle, documents = fit_read
    full = data.load(name, split or "train")
    n = len(full)
    return {full.texts[i] for i in (range(min(documents, n)) if shuffle is None else act.pick(n, documents, shuffle))}


def _docs(task: str, split: str, n: int, seed: int, fit_read: tuple[str, int | None, int] | None = None) -> Any:
    """The split and n of its document ids in a seeded order, leaving out those a fit read (`SuiteConfig.fit_read`)."""
    from conceptlens import data

    full = data.load(task, split)
    return full, _unread(full, n, seed, _read_texts(fit_read, task))


def _unread(full: Any, n: int, seed: int, read: set[str]) -> list[int]:
    """`act.pick_unread`, refusing a split whose every document the fit read."""
    picked = act.pick_unread(full, n, seed, read)
    if not picked:
        raise ValueError(f"{full.name} {full.split} holds {len(full)} documents, all read by the fit")
    return picked


def held_out(task: str, n_train: int, n_test: int, seed: int, fit_read: tuple[str, int | None, int] | None = None,
             top_up: bool = False) -> tuple[list[tuple[Any, int]], list[tuple[Any, int]], int]:
    """(train, test) documents as (set, id) for probing `task`, and how many of the test ones the test
    split gave. Train: `n_train` train-split documents the fit did not read (`_docs`). Test: up to
    `n_test` test-split documents in a seeded order, then with `top_up` train-split documents after the
    probes'; a document whose text the fit or the probes read, or that is already scored, is passed
    over (bbc-news repeats some articles within and across its splits), so each is held out."""
    from conceptlens import data

    train_set, test_set = data.load(task, "train"), data.load(task, "test")
    read = _read_texts(fit_read, task)
    picked, test_order = _unread(train_set, len(train_set), seed, read), act.pick(len(test_set), len(test_set), seed)
    seen = read | {train_set.texts[i] for i in picked[:n_train]}
    test: list[tuple[Any, int]] = []
    for full, ids in ((test_set, test_order), (train_set, picked[n_train:] if top_up else [])):
        for i in ids:
            if len(test) < n_test and full.texts[i] not in seen:
                seen.add(full.texts[i])
                test.append((full, i))
    if not test:
        raise ValueError(f"{task}: every test document was read by the fit or the probes; fit on the train split "
                         "(the default) to leave held-out documents")
    return [(train_set, i) for i in picked[:n_train]], test, sum(full is test_set for full, _ in test)


def _reconstruction(lens: AttachedModel, tok: Any, site: str, decoders: Mapping[str, act.ConceptEncoder],
                    config: SuiteConfig) -> list[Line]:
    from conceptlens.evaluate.reconstruction import reconstruction_lines

    def batches(split: str) -> list[dict[str, torch.Tensor]]:
        # held-out text: no test article whose text the fit read (bbc-news's test split repeats train articles);
        # the train split only gives the site's mean (mean-ablation), which any text may give
        fit_read = config.fit_read if split == "test" else None
        full, picked = _docs(config.recon_data, split, config.recon_docs, config.seed, fit_read)
        texts = [full.texts[i] for i in picked]
        return [encode_batch(tok, texts[i:i + config.batch_size], config.max_length)
                for i in range(0, len(texts), config.batch_size)]

    total, count = torch.zeros((), dtype=torch.float64), 0

    def add(x: torch.Tensor, _: torch.Tensor) -> None:
        nonlocal total, count
        total, count = total + x.double().sum(0), count + len(x)

    act.collect(lens, site, {}, ((b, torch.zeros(len(b["input_ids"]))) for b in batches("train")), add)
    if count == 0:
        raise ValueError(f"the {config.recon_data} training documents left no token at {site} to take its mean from")
    return reconstruction_lines(lens, site, decoders, batches("test"), (total / count).float(), config.seed)


def capture_task(lens: AttachedModel, tok: Any, site: str, readers: Mapping[str, Reader], task: str,
                 config: SuiteConfig, docs: tuple[int, int] | None = None,
                 top_up: bool = False) -> tuple[act.Probed, act.Probed, list[str]]:
    """Train and test rows of labelled set `task` at `site`, every reader's columns mean-pooled per
    document (or per labelled token), and the class names. `docs`: documents drawn from each split
    (default `config.max_docs` each); train documents a fit read (`config.fit_read`) are passed over.
    With `top_up`, test documents past the test split's own are train-split documents after the
    probes'; none is a text the fit or the probes read (`held_out`)."""
    from conceptlens import data

    token_level = task in act.TOKEN_TASKS
    n_train, n_test = docs or (config.max_docs, config.max_docs)
    train, test, _ = held_out(task, n_train, n_test, config.seed, config.fit_read, top_up)
    units = {"train": train, "test": test}
    tag_ids, class_names = act.label_ids(data.load(task, "train"), token_level, config.max_classes)
    probed = {}
    for split, chosen in units.items():
        batches = act.task_batches(tok, [full.texts[i] for full, i in chosen],
                                   [act.label_of(full, i, token_level) for full, i in chosen], token_level=token_level,
                                   tag_ids=tag_ids, batch_size=config.batch_size, max_length=config.max_length)
        probed[split] = act.collect(lens, site, dict(readers), _bar(batches, f"{task} {split}", config.progress))
    return probed["train"], probed["test"], class_names


def _probing(lens: AttachedModel, tok: Any, site: str, encoders: Mapping[str, act.ConceptEncoder], sets: Mapping[str, ConceptSet],
             task: str, part: str, config: SuiteConfig) -> list[Line]:
    if part == "quality":
        train, test, class_names = capture_task(lens, tok, site, {n: e.encode for n, e in encoders.items()}, task,
                                                config)
        return _quality(task, train, test, sets, class_names, config)
    from conceptlens.evaluate.probing import concept_probe_lines, probing_lines

    readings = tuple(dict.fromkeys(("activation", *config.readings)))  # the concept pages read activations
    readers = probe_readers(sets, readings, draws=config.random_draws, seed=config.seed)
    train, test, class_names = capture_task(lens, tok, site, readers, task, config)
    lines = [ln for reading in config.readings
             for ln in probing_lines(task, train, test, class_names, reading=reading, ks=config.ks, seed=config.seed)]
    if config.concept_top:
        lines += concept_probe_lines(task, train, test, class_names, top=config.concept_top, seed=config.seed)
    return lines


def _quality(task: str, train: act.Probed, test: act.Probed, sets: Mapping[str, ConceptSet], class_names: list[str],
             config: SuiteConfig) -> list[Line]:
    from conceptlens.evaluate.table import Features, metric_rows

    lines = []
    for name, cs in sets.items():
        directions = (cs.centred() if cs.mean is not None else cs).directions  # as the activations read them
        rows = metric_rows(directions, Features(train.x, train.z[name], train.y),
                           Features(test.x, test.z[name], test.y), class_names, None, config.probe_candidates)
        for r in rows:
            bases = [] if math.isnan(r.baseline) else [(r.baseline_name, _point(r.baseline))]
            lines.append(Line(name, f"{task} {r.metric.strip()}", _point(r.value), bases, r.note))
    return lines


def _point(value: float) -> Estimate:
    return Estimate(value, math.nan, math.nan)


def _bar(items: Iterable, desc: str, on: bool) -> Iterable:
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit="batch", disable=not on, dynamic_ncols=True, leave=False)
