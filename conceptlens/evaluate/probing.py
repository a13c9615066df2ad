"""k-sparse probing (SAEBench's protocol) with its controls, on balanced binary tasks.

    tasks = binary_tasks(train.y, test.y, class_names)            # one-vs-rest, balanced
    probe = fit_sparse_probe(z_train, y_train, k=5)              # top-5 mean difference + logistic
    readers = readings.probe_readers(sets, draws=5)              # the rows' columns: sets and controls
    lines = probing_lines("bbc-news", train, test, class_names, reading="code", ks=(1, 2, 5, 20))

For each binary task the k latents with the largest |mean(class 1) - mean(class 0)| on the
train split are kept and a logistic regression (scikit-learn, C = 1, on features standardised
with the train mean and deviation) is fitted on them; the figure is its test accuracy, averaged
over a set's binary tasks (or per task, `by_task`). Multi-class sets become one-vs-rest tasks;
each task is balanced by subsampling its larger side (seeded), in train and test, so chance is
0.5 (SAEBench balances its tasks too). Controls, on the same rows: the same k-sparse probe on as
many random unit directions of the site as the set has concepts, read as the set is read
(`readings`: by activations, or by codes through the same nonlinearity; several draws), the
diff-of-means direction of the train split (one feature), and a logistic probe on all raw
activations (the supervised ceiling). Intervals: bootstrap over test documents (`bootstrap`).

`concept_probe_lines` scores single concepts for the atlas's concept pages: per task, each of the
`top` latents with the largest mean difference alone (a 1-feature probe; the k = 1 probe when it
ranks first), next to that task's matched random control at k = 1 and its diff-of-means direction.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from conceptlens.evaluate.activations import Probed, TokenColumns
from conceptlens.evaluate.bootstrap import Estimate, bootstrap, bootstrap_draws, per_document
from conceptlens.evaluate.lines import Line
from conceptlens.evaluate.readings import Chosen, check_reading, choose, column, random_directions

KS = (1, 2, 5, 20)
RANDOM_DRAWS = 20
"""Draws of the random-direction control. Its interval pools every (draw, document replicate) pair,
so its upper bound estimates the top of the draws' spread; with few draws it sits low (the best of
5 draws lies about 1.2 standard deviations above their mean, the 97.5th percentile about 2). On the
demo's run (EVALUATION.md, "The demo's own table") the dense sets' k = 5 upper bounds with 5
draws lay below those with 50 on all 10 topics (by up to 0.065); with 20, 9 of 15 cells above and 6
below, within 0.041."""
CONCEPT_TOP = 5
"""latents per task that `concept_probe_lines` scores alone"""


class BinaryTask(NamedTuple):
    name: str
    train: Tensor
    """row indices of the train split (balanced)"""
    test: Tensor
    """row indices of the test split (balanced)"""
    y_train: Tensor
    """`(len(train),)` 0/1"""
    y_test: Tensor


def _balanced(y: Tensor, g: torch.Generator) -> Tensor:
    """Indices of every row of the smaller side of 0/1 labels `y` and as many of the larger, sorted."""
    pos, neg = (y == 1).nonzero().flatten(), (y == 0).nonzero().flatten()
    n = min(len(pos), len(neg))
    return torch.cat([side[torch.randperm(len(side), generator=g)[:n]] for side in (pos, neg)]).sort().values


def binary_tasks(y_train: Tensor, y_test: Tensor, class_names: list[str], seed: int = 0) -> list[BinaryTask]:
    """One balanced task per class (one-vs-rest), or the single task of a two-class set. The train and
    the test rows are drawn from generators of their own, so that a task's train rows (what its probes
    learn on) do not depend on the test split (with one generator, a larger test split moved every
    later class's train rows)."""
    g_train, g_test = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1_000_003)
    classes = [1] if len(class_names) == 2 else range(len(class_names))
    tasks = []
    for c in classes:
        train, test = _balanced((y_train == c).long(), g_train), _balanced((y_test == c).long(), g_test)
        if len(train) and len(test):
            tasks.append(BinaryTask(class_names[c], train, test, (y_train[train] == c).long(), (y_test[test] == c).long()))
    return tasks


def top_mean_difference(z: Tensor, y: Tensor, k: int) -> Tensor:
    """Indices of the k columns of `z` `(N, n)` with the largest |mean over y=1 - mean over y=0|."""
    diff = (z[y == 1].double().mean(0) - z[y == 0].double().mean(0)).abs()
    return diff.topk(min(k, z.shape[1])).indices


def sides(tasks: list[BinaryTask]) -> list[tuple[Tensor, Tensor]]:
    """Per task, the ids of its class-1 and its class-0 train rows (sorted): what `readings.choose` ranks by."""
    return [(t.train[t.y_train == 1], t.train[t.y_train == 0]) for t in tasks]


class SparseProbe(NamedTuple):
    features: Tensor
    """`(k,)` the selected columns"""
    model: Any
    """a fitted scikit-learn pipeline: StandardScaler then LogisticRegression"""

    def predict(self, z: Tensor) -> Tensor:
        """`(N, n)` -> `(N,)` 0/1 predictions."""
        return torch.from_numpy(self.model.predict(z[:, self.features].double().numpy()))


def fit_logistic(x: Tensor, y: Tensor, C: float = 1.0) -> Any:
    """scikit-learn's LogisticRegression(C) on features standardised with their train mean and deviation."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=1000)).fit(x.double().numpy(), y.numpy())


def fit_sparse_probe(z: Tensor, y: Tensor, k: int, C: float = 1.0) -> SparseProbe:
    """SAEBench's k-sparse probe: the top-k mean-difference columns of `z` `(N, n)`, then `fit_logistic`."""
    features = top_mean_difference(z, y, k)
    return SparseProbe(features, fit_logistic(z[:, features], y, C))


def sparse_probe_accuracies(chosen: Chosen, tasks: list[BinaryTask], doc: Tensor, n_docs: int) -> list[Tensor]:
    """Per size of `chosen`, the per-document (correct, count) columns of every task's k-sparse probe on
    its chosen latents (`_correct_per_doc`): `fit_sparse_probe` on the rows of the column's `keep` latents."""
    out = []
    for i in range(len(chosen.features[0])):
        preds = []
        for j, t in enumerate(tasks):
            at = chosen.at(chosen.features[j][i])  # gather the task's rows of those latents only
            model = fit_logistic(chosen.train[t.train[:, None], at], t.y_train)
            preds.append(torch.from_numpy(model.predict(chosen.test[t.test[:, None], at].double().numpy())))
        out.append(_correct_per_doc(tasks, preds, doc, n_docs))
    return out


def _correct_per_doc(tasks: list[BinaryTask], predictions: list[Tensor], doc: Tensor, n_docs: int) -> Tensor:
    """`(n_docs, 2 * tasks)`: per task, correct test rows and test rows, summed by document."""
    cols = [torch.stack([(p == t.y_test).double(), torch.ones(len(p), dtype=torch.float64)], 1)
            for t, p in zip(tasks, predictions)]
    return torch.cat([per_document(c, doc[t.test], n_docs) for c, t in zip(cols, tasks)], 1)


def mean_accuracy(t: Tensor) -> Tensor:
    """Statistic: accuracy averaged over tasks, from `(..., 2 * tasks)` columns (correct, count)."""
    return (t[..., 0::2] / t[..., 1::2]).mean(-1)


def sparse_probe_accuracy(z_train: Tensor, z_test: Tensor, tasks: list[BinaryTask], k: int, doc: Tensor,
                          n_docs: int) -> Tensor:
    """Per-document (correct, count) columns of the k-sparse probe of every task: see `_correct_per_doc`."""
    chosen = choose({"z": z_train}, {"z": z_test}, "z", sides(tasks), (k,))
    return sparse_probe_accuracies(chosen, tasks, doc, n_docs)[0]


def _dense_accuracy(train: Probed, test: Probed, tasks: list[BinaryTask], n_docs: int, diff_of_means: bool) -> Tensor:
    preds = []
    for t in tasks:
        x_train, x_test = train.x[t.train].double(), test.x[t.test].double()
        if diff_of_means:
            w = x_train[t.y_train == 1].mean(0) - x_train[t.y_train == 0].mean(0)
            x_train, x_test = (x_train @ w)[:, None], (x_test @ w)[:, None]
        model = fit_logistic(x_train, t.y_train)
        preds.append(torch.from_numpy(model.predict(x_test.numpy())))
    return _correct_per_doc(tasks, preds, test.doc, n_docs)


def controls_of(probed: Probed, name: str, reading: str) -> list[str]:
    """The `Probed.z` columns of set `name`'s control draws under `reading` (`readings.probe_readers`)."""
    found: list[str] = []
    while column(name, reading, len(found)) in probed.z:
        found.append(column(name, reading, len(found)))
    if not found:
        raise ValueError(f"no control columns for {name!r} read by {reading!r}: collect the rows with "
                         "readings.probe_readers(sets, ...) as the encoders")
    return found


def set_names(probed: Probed, reading: str = "activation") -> list[str]:
    """The sets read by `reading` in `probed` (control columns left out)."""
    names = dict.fromkeys(key.split("/")[0] for key in probed.z)
    return [name for name in names if column(name, reading) in probed.z]


def _tasks_mean(js: list[int]):
    """Statistic: the accuracy averaged over tasks `js`, from the (correct, count) columns of every task."""
    return lambda t: torch.stack([t[..., 2 * j] / t[..., 2 * j + 1] for j in js]).mean(0)


def probing_lines(task: str, train: Probed, test: Probed, class_names: list[str], *, reading: str = "activation",
                  ks: Sequence[int] = KS, seed: int = 0, by_task: bool = False) -> list[Line]:
    """Test accuracy of every set's k-sparse probe per k (averaged over the binary tasks, or one line per
    task with `by_task`), next to its matched random control, the diff-of-means direction and the full
    probe; sets and controls read by `reading` (columns of `readings.probe_readers`)."""
    check_reading(reading)
    tasks = binary_tasks(train.y, test.y, class_names, seed)
    if not tasks:
        raise ValueError(f"{task}: no class has examples in both splits")
    n_docs = int(test.doc.max()) + 1
    groups = ([(f"{t.name} k={{k}} accuracy", [j]) for j, t in enumerate(tasks)] if by_task
              else [(f"{task} k={{k}} accuracy", list(range(len(tasks))))])
    dense = {base: _dense_accuracy(train, test, tasks, n_docs, base == "diff-of-means")
             for base in ("diff-of-means", "full probe")}
    stats = {metric: _tasks_mean(js) for metric, js in groups}
    dense_bases = {metric: [(base, bootstrap(cols, stat, seed=seed)) for base, cols in dense.items()]
                   for metric, stat in stats.items()}  # the same for every set and k
    suffix = "" if reading == "activation" else f", {reading}s"
    each = int(np.mean([len(t.test) for t in tasks]))
    notes = {metric: (f"balanced binary task, {len(tasks[js[0]].test)} test rows" if by_task
                      else f"{len(tasks)} balanced binary task(s), {each} test rows each") for metric, js in groups}
    accuracies = _column_accuracies(train, test, tasks, ks, n_docs)
    lines = []
    for name in set_names(train, reading):
        n, ours = accuracies(column(name, reading))
        controls = [accuracies(c)[1] for c in controls_of(train, name, reading)]
        for i, k in enumerate(ks):
            rand = [control[i] for control in controls]
            for metric, stat in stats.items():
                bases = [(f"random {n} dirs{suffix}", bootstrap_draws(rand, stat, seed=seed)), *dense_bases[metric]]
                lines.append(Line(name, metric.format(k=k) + suffix, bootstrap(ours[i], stat, seed=seed), bases,
                                  notes[metric]))
    return lines


def _column_accuracies(train: Probed, test: Probed, tasks: list[BinaryTask], ks: Sequence[int], n_docs: int):
    """column -> (its latents, its per-k `sparse_probe_accuracies`), each column read one at a time;
    columns that share a reader or tensor (controls shared between sets, `readings.probe_readers`) are
    probed once."""
    done: dict[tuple[int, int], tuple[int, list[Tensor]]] = {}

    def accuracies(name: str) -> tuple[int, list[Tensor]]:
        key = (_source(train.z, name), _source(test.z, name))
        if key not in done:
            chosen = choose(train.z, test.z, name, sides(tasks), ks)
            done[key] = chosen.diff.shape[1], sparse_probe_accuracies(chosen, tasks, test.doc, n_docs)
        return done[key]
    return accuracies


def _source(z: Mapping[str, Tensor], name: str) -> int:
    """The identity of what column `name` is read from: its reader in a `TokenColumns`, else its tensor."""
    return id(z.readers[name] if isinstance(z, TokenColumns) else z[name])


def _task_accuracy(j: int):
    """Statistic: the accuracy of task j alone, from the (correct, count) columns of every task."""
    return lambda t: t[..., 2 * j] / t[..., 2 * j + 1]


def concept_probe_lines(task: str, train: Probed, test: Probed, class_names: list[str], *, top: int = CONCEPT_TOP,
                        seed: int = 0) -> list[Line]:
    """Per binary task and set, the test accuracy of each of the `top` largest-mean-difference latents
    alone (a 1-feature probe), as lines with `concept` set; baselines: the task's k = 1 probe on the
    set's control draws (activation reading, as `probing_lines`) and its diff-of-means direction."""
    tasks = binary_tasks(train.y, test.y, class_names, seed)
    n_docs = int(test.doc.max()) + 1
    dom = _dense_accuracy(train, test, tasks, n_docs, True)
    accuracies = _column_accuracies(train, test, tasks, (1,), n_docs)
    lines = []
    for name in set_names(train):
        chosen = choose(train.z, test.z, name, sides(tasks), (top,))
        n = chosen.diff.shape[1]
        controls = [accuracies(c)[1][0] for c in controls_of(train, name, "activation")]
        for j, t in enumerate(tasks):
            bases = [(f"random {n} dirs, best 1", bootstrap_draws(controls, _task_accuracy(j), seed=seed)),
                     ("diff-of-means", bootstrap(dom, _task_accuracy(j), seed=seed))]
            z_train, z_test = chosen.train[t.train].double(), chosen.test[t.test].double()
            ranked = chosen.features[j][0]
            for rank, (c, at) in enumerate(zip(ranked.tolist(), chosen.at(ranked).tolist())):
                model = fit_logistic(z_train[:, [at]], t.y_train)
                pred = torch.from_numpy(model.predict(z_test[:, [at]].numpy()))
                est = bootstrap(_correct_per_doc([t], [pred], test.doc, n_docs), mean_accuracy, seed=seed)
                side = "higher" if chosen.diff[j, c] > 0 else "lower"
                lines.append(Line(name, f"{task} {t.name}: accuracy of this concept alone", est, bases,
                                  f"rank {rank + 1} of {n} by mean difference ({side} on {t.name})", concept=c))
    return lines


__all__ = ["CONCEPT_TOP", "KS", "BinaryTask", "Estimate", "SparseProbe", "binary_tasks", "concept_probe_lines",
           "controls_of", "fit_logistic", "fit_sparse_probe", "mean_accuracy", "probing_lines", "random_directions",
           "set_names", "sides", "sparse_probe_accuracies", "sparse_probe_accuracy", "top_mean_difference"]
