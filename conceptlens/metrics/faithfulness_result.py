"""What `faithfulness` returns: the task metric clean, ablated, under controls, and its baseline.

    print(result.summary())        # every figure next to its baseline, plus warnings
    result.warnings                # why the comparison with the controls may mean little
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

UNITS = {"next_token_loss": "nats", "log_loss": "nats", "accuracy": "fraction"}
BASELINES = {"next_token_loss": "unigram entropy", "log_loss": "base-rate entropy", "accuracy": "chance"}
CONTROLS = {"random": "isotropic random directions", "covariance": "random directions with the activation covariance",
            "concepts": "random concepts of the same set"}


class FaithfulnessResult(NamedTuple):
    """Task metric clean, with the concepts ablated, and with each control ablated."""

    metric: str
    """What was measured: "next_token_loss" (nats), "log_loss" (nats) or "accuracy"."""
    clean: float
    ablated: float
    controls: Tensor
    """(n_controls,) the metric with each control set ablated."""
    n_directions: int
    """Rank of the ablated span (and of each control)."""
    baseline: float = math.nan
    """The metric of a predictor that ignores the model (see `BASELINES`): unigram entropy of
    the targets, base-rate entropy of the test labels, or the majority-class accuracy."""
    zero_ablated: float = math.nan
    """The metric with the whole site set to zero at the edited positions (a reference ceiling)."""
    control_kind: str = "random"
    """Which controls (`CONTROLS`)."""
    mode: str = "projection"
    """How the concepts were ablated (`conceptlens.steering.ablate`)."""

    @property
    def control_mean(self) -> float:
        return float(self.controls.mean())

    @property
    def control_std(self) -> float:
        return float(self.controls.std())

    @property
    def harm(self) -> float:
        """How much worse the ablation makes the task (positive = worse)."""
        return self._worse(self.ablated)

    @property
    def control_harm(self) -> float:
        """Mean harm of the controls."""
        return self._worse(self.control_mean)

    @property
    def z(self) -> float:
        """(harm - control harm) in control standard deviations."""
        return (self.harm - self.control_harm) / self.control_std if self.control_std > 0 else math.nan

    @property
    def margin(self) -> float:
        """How much better than its baseline the clean model does (nan without a baseline)."""
        return self._worse(self.baseline)

    def _worse(self, value: float) -> float:
        return self.clean - value if self.metric == "accuracy" else value - self.clean

    @property
    def warnings(self) -> list[str]:
        """Reasons the comparison with the controls may be meaningless (empty when none applies)."""
        out = []
        n, std, control_harm = len(self.controls), self.control_std, self.control_harm
        if self.margin <= 0:
            out.append(f"the clean model does not beat the {BASELINES[self.metric]} ({self.clean:.4f} vs "
                       f"{self.baseline:.4f}): there is nothing for an ablation to remove")
        elif control_harm > 0.5 * self.margin:
            out.append(f"the controls alone remove {control_harm / self.margin:.0%} of the clean model's margin over "
                       f"its baseline ({BASELINES[self.metric]} {self.baseline:.4f}): this site cannot lose "
                       f"{self.n_directions} directions without breaking the task, so any concept looks harmful; "
                       "ablate fewer directions")
        scale = max(abs(self.harm), self.margin if self.margin > 0 else 0.0)  # nan margin: the harm alone
        if std > 0.5 * control_harm > 0.05 * scale:  # a spread that matters: controls that really hurt, unevenly
            out.append(f"the controls disagree (harm {control_harm:+.4f} +- {std:.4f}, n={n}): their mean is no "
                       "stable reference and z is noise; use more controls or matched ones")
        if math.isnan(self.z):
            out.append("the controls have no spread: z is undefined")
        elif abs(self.z) < 2:
            out.append(f"the concepts' harm is within 2 control standard deviations (z = {self.z:.1f}): "
                       "not distinguishable from the controls")
        if n < 5:
            out.append(f"only {n} controls: their spread, and z, are rough")
        return out

    def summary(self) -> str:
        unit, base = UNITS.get(self.metric, ""), BASELINES.get(self.metric, "baseline")
        baseline = "" if math.isnan(self.baseline) else f" ({base} {self.baseline:.4f})"
        lines = [
            f"{self.metric} ({unit}): clean {self.clean:.4f}{baseline}; "
            f"ablated ({self.n_directions} directions, {self.mode}) {self.ablated:.4f}, harm {self.harm:+.4f}",
            f"  controls: {len(self.controls)} x {CONTROLS.get(self.control_kind, self.control_kind)}: "
            f"{self.control_mean:.4f} +- {self.control_std:.4f}, harm {self.control_harm:+.4f}; z = {self.z:.1f}",
        ]
        if not math.isnan(self.zero_ablated):
            lines.append(f"  site zeroed at the same positions: {self.zero_ablated:.4f}, "
                         f"harm {self._worse(self.zero_ablated):+.4f}")
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def controls_tensor(values: list[float]) -> Tensor:
    return torch.tensor(values, dtype=torch.float64)
