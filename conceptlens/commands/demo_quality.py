"""The demo's quality table: every number next to its baseline, from the run's own descriptions.

    rows = quality_rows(descriptions, fit_stats)       # descriptions: name -> Description
    print(format_quality(rows)); write_quality(rows, "runs/demo/quality.json")

Probe loss: per class, the test log-loss of the best single concept (a 1-D logistic probe on
document-mean activations, trained on the even described documents, scored on the odd ones),
next to the class's base-rate entropy (the loss of always predicting the class rate). Taking
the best of n concepts on the test half flatters every set a little, so the table has a
`random/n` row per set size n: the same selection over the first n random directions (best
of n against best of n), the baseline for that.
Effective rank of the directions (exp of the entropy of the normalised singular values)
next to the random set's; FVU / L0 for sets that reconstruct, from the fit's own statistics.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

import torch

from conceptlens._io import atomic_write
from conceptlens.metrics.quality import effective_rank


def best_per_class(description: Any, n: int | None = None) -> dict[str, tuple[float, int]]:
    """class -> (best probe loss, concept) over the set's first n concepts (all: None; nan classes left out)."""
    loss = description.stats.get("probe_loss")
    loss = None if loss is None else loss[:n]
    labels = description.info.get("labels") or []
    out: dict[str, tuple[float, int]] = {}
    if loss is None:
        return out
    for c, label in enumerate(labels):
        col = loss[:, c].double()
        if torch.isfinite(col).any():
            j = int(torch.where(torch.isfinite(col), col, math.inf).argmin())
            out[label] = (float(col[j]), j)
    return out


def quality_rows(descriptions: Mapping[str, Any], directions: Mapping[str, torch.Tensor],
                 fit_stats: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """name -> {"probe": {class: (loss, concept)}, "effective rank": ..., "FVU": ..., "L0": ...}."""
    rows = {}
    sizes = sorted({int(d.info["n_concepts"]) for name, d in descriptions.items() if name != "random"})
    for name, d in descriptions.items():
        if name == "random":  # the control, matched in count to each set: best of n against best of n
            for n in sizes:
                rows[f"random/{n}"] = {"probe": best_per_class(d, n), "n": n,
                                       "effective rank": effective_rank(directions[name][:n], unit=True)}
            continue
        row: dict[str, Any] = {"probe": best_per_class(d), "n": int(d.info["n_concepts"]),
                               "effective rank": effective_rank(directions[name], unit=True)}
        mean = getattr(fit_stats.get(name), "mean", None)  # an SAE's SAEStats: EMA of its last ~100 steps
        if mean is not None:
            row["FVU"], row["L0"] = float(mean.fvu), float(mean.l0)
        rows[name] = row
    return rows


def format_quality(rows: Mapping[str, Mapping[str, Any]], base_rate: Mapping[str, float]) -> str:
    """A text table: one column per set, one row per class and metric, baselines in the last column."""
    names = list(rows)
    classes = [c for c in base_rate if any(c in rows[n]["probe"] for n in names)]
    width = max(10, *(len(n) for n in names))
    head = f"{'':<26}" + "".join(f"{n:>{width + 2}}" for n in names) + "   baseline"
    lines = [head, "probe log-loss, best concept per class (lower is better):"]
    for c in classes:
        cells = "".join(f"{rows[n]['probe'][c][0]:>{width + 2}.3f}" if c in rows[n]["probe"] else " " * (width + 2)
                        for n in names)
        lines.append(f"  {c:<24}{cells}   {base_rate[c]:.3f} base-rate entropy")
    lines.append(f"{'effective rank':<26}" + "".join(f"{rows[n]['effective rank']:>{width + 2}.1f}" for n in names)
                 + "   random row; max min(n, d)")
    for metric, baseline in (("FVU", "1.0 = predicting the mean"), ("L0", "k of a TopK SAE")):
        if any(metric in rows[n] for n in names):
            cells = "".join(f"{rows[n][metric]:>{width + 2}.3f}" if metric in rows[n] else f"{'-':>{width + 2}}"
                            for n in names)
            lines.append(f"{metric + ' (fit, last steps)':<26}{cells}   {baseline}")
    return "\n".join(lines)


def write_quality(rows: Mapping[str, Mapping[str, Any]], base_rate: Mapping[str, float], path: str | Path,
                  note: str = "") -> None:
    """`quality.json` for the report: per set, flat metric -> value, and the baseline row."""
    table: dict[str, dict[str, Any]] = {}
    for name, row in rows.items():
        flat = {f"probe {c}": loss for c, (loss, _) in row["probe"].items()}
        flat["effective rank"] = row["effective rank"]
        flat |= {k: row[k] for k in ("FVU", "L0") if k in row}
        table[name] = flat
    baseline = {f"probe {c}": v for c, v in base_rate.items()} | {"FVU": 1.0}
    text = json.dumps({"extractors": table, "baseline": baseline, "note": note}, indent=1)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))

