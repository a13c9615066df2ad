"""The demo's probe table: per topic, each set's k-sparse probe against matched random directions.

    lines, train = run_probes(lens, tok, sets, site, n_train=240, n_test=1000, max_length=64, draws=5, seed=0)

The suite's probing part (`evaluate.probing`, sets and controls read by `evaluate.readings`) with
one line per bbc-news topic: a balanced one-vs-rest task per topic, the k concepts with the
largest mean difference on the train-split documents, a logistic regression on them, its accuracy
on held-out documents (the test split's, then train-split articles that neither the fit nor the
probes read: `suite.capture_task`'s top-up; bootstrap interval over those documents), next to as many random
directions as the set has concepts read the same way (`draws` draws, the interval pooling draws
and document replicates) and the full probe on every coordinate (the supervised ceiling). One
capture pass per split reads every set by both readings, so the second costs no model pass.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from conceptlens.evaluate.lines import Line, verdict
from conceptlens.evaluate.readings import READ_NOTE, READINGS

TASK = "bbc-news"
CEILING = "full probe"
PART = "demo: k-sparse probe per bbc-news topic"
"""The probe table's part in RUN/eval.json (`save_part`), beside `conceptlens eval`'s parts"""


def probe_rows(lens: Any, tok: Any, sets: dict[str, Any], site: str, *, n_train: int, n_test: int, max_length: int,
               draws: int, seed: int, fitted: int = 0) -> tuple[Any, Any, list[str]]:
    """bbc-news train and test rows (`evaluate.activations.Probed`, documents mean-pooled) with every
    set read by every reading next to its control draws, and the topic names; the train articles
    come after the `fitted` the fit read (the same seeded order), so no probe learns on them, and
    test articles past the test split's come after the probes' train articles (`top_up`)."""
    from conceptlens.evaluate.readings import probe_readers
    from conceptlens.evaluate.suite import SuiteConfig, capture_task

    config = SuiteConfig(suites=("probing",), tasks=(TASK,), max_length=max_length, random_draws=draws, seed=seed,
                         fit_read=(TASK, seed, fitted))  # the fit's shuffle is the demo's seed
    readers = probe_readers(sets, READINGS, draws=draws, seed=seed)
    return capture_task(lens, tok, site, readers, TASK, config, docs=(n_train, n_test), top_up=True)


def topic_lines(train: Any, test: Any, class_names: list[str], *, k: int = 5, seed: int = 0,
                reading: str = "code") -> list[Line]:
    """One line per (set, topic): the k-sparse probe next to its matched control, diff-of-means and the
    full probe (`evaluate.probing.probing_lines` with `by_task`)."""
    from conceptlens.evaluate.probing import probing_lines

    return probing_lines(TASK, train, test, class_names, reading=reading, ks=(k,), seed=seed, by_task=True)


def _topic(line: Line) -> str:
    return line.metric.split(" ")[0]


def format_topics(lines: list[Line]) -> str:
    """Topics down, sets across: `value [interval]` over the control's, and the verdict; then the
    topic's supervised ceiling, once."""
    sets = list(dict.fromkeys(ln.extractor for ln in lines))
    topics = list(dict.fromkeys(ln.metric for ln in lines))
    cell = {(ln.extractor, ln.metric): ln for ln in lines}
    width = 34
    out = [f"{'':<24}" + "".join(f"{s:>{width}}" for s in sets)]
    for topic in topics:
        ours, control = f"  {topic.split(',')[0]:<22}", f"  {'  matched random':<22}"
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
        short = [f"{_topic(ln)} ({verdict(ln)})" for ln in mine if verdict(ln) != "wins"]
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
            cells.append(f"{_topic(ln)} {ceiling.value - ln.baselines[0][1].high:+.3f}")
    return ", ".join(cells) or "no ceiling measured"


def probe_skip(fitted: int, n_train: int, articles: int) -> tuple[int, str]:
    """(train articles the probes pass over, what the header says of them): the `fitted` the fit read,
    or as many as leave `n_train` of the split's `articles` when a large fit read more."""
    skip = min(fitted, max(articles - n_train, 0))
    if not fitted:
        return 0, ""
    read = f" ({fitted - skip} of them read by the fit, which read {fitted})"
    return skip, " outside the fit" if skip == fitted else read


def run_probes(lens: Any, tok: Any, sets: dict[str, Any], site: str, *, n_train: int, n_test: int,
               max_length: int, draws: int, seed: int, k: int = 5, reading: str = "code",
               fitted: int = 0) -> tuple[list[Line], Any]:
    """Capture the probe documents, print the per-topic table and its plain summary, then the summary
    of the other reading (`READINGS`, on the same rows); the lines of both readings (the atlas shows
    both, as the demo prints both verdicts) and the train rows (which the demo's steering baseline reuses)."""
    from conceptlens import data
    from conceptlens.evaluate.suite import held_out

    skip, where = probe_skip(fitted, n_train, len(data.load(TASK, "train")))
    _, test, from_test = held_out(TASK, n_train, n_test, seed, (TASK, seed, skip), top_up=True)
    scored = f"{from_test} test-split articles" + (
        f" and {len(test) - from_test} train-split articles" if len(test) > from_test else "") + (
        ", none a text the fit or the probes read")
    print(f"\nk = {k} sparse probe per topic (SAEBench's protocol) on held-out documents: concepts chosen and "
          f"probes fitted on {n_train} train-split articles{where}, scored on {scored} (first "
          f"{max_length} tokens each, mean-pooled, balanced one-vs-rest); control: as many random directions as "
          f"the set has concepts, read and pooled the same way, {draws} draws; 95% bootstrap intervals over test "
          f"documents; {READ_NOTE[reading]}")
    train, test, names = probe_rows(lens, tok, sets, site, n_train=n_train, n_test=n_test, max_length=max_length,
                                    draws=draws, seed=seed, fitted=skip)
    lines = topic_lines(train, test, names, k=k, seed=seed, reading=reading)
    print(format_topics(lines))
    print(summary(lines))
    other = next(r for r in READINGS if r != reading)
    print(f"The same probes, {READ_NOTE[other]} (--probe-read {other}):")
    other_lines = topic_lines(train, test, names, k=k, seed=seed, reading=other)
    print(summary(other_lines))
    return lines + other_lines, train


def reconstruction(lens: Any, tok: Any, sets: dict[str, Any], docs: int, seed: int, fitted: int) -> list[Line]:
    """CE-loss recovered (and KL) of the sets that reconstruct, next to zero- and mean-ablation, printed;
    on test articles none of which repeats the text of one of the `fitted` train articles the fit read."""
    from conceptlens.evaluate.activations import concept_encoder
    from conceptlens.evaluate.lines import format_lines
    from conceptlens.evaluate.suite import SuiteConfig, run_suite

    decoding = {name: cs for name, cs in sets.items() if concept_encoder(cs).decode is not None}
    if not decoding:
        return []
    lines = run_suite(lens, tok, decoding, SuiteConfig(suites=("reconstruction",), recon_docs=docs, seed=seed,
                                                       fit_read=(TASK, seed, fitted)))
    keep = [ln for ln in lines if ln.metric in ("CE loss recovered", "KL to clean (nats/token)", "FVU")]
    print(f"\nReconstruction spliced in at the site on {docs} held-out test-split articles (95% bootstrap intervals):")
    print(format_lines(keep))
    return keep


def save_part(args: argparse.Namespace, sets: dict, site: str, part: str, config: dict, seconds: float,
              lines: list) -> None:
    """Merge the demo's figures into RUN/eval.json as a part of their own, so that the atlas's index
    shows them as the suite's table (`conceptlens eval` on the folder adds its parts beside them)."""
    from conceptlens.evaluate import results
    from conceptlens.evaluate.activations import concept_encoder

    if not lines:
        return
    infos = {name: results.set_info(cs, Path(args.out) / "concepts" / name, site, concept_encoder(cs).kind)
             for name, cs in sets.items()}
    results.save_part(args.out, results.Part(args.model, infos, site, part, config, seconds), lines,
                      results.interval_text(args.probe_draws))
