"""The lines `conceptlens fit` prints per extractor: at the start the lr it chose for an SAE's
budget; at the end FVU, L0 and optimiser steps, and a warning for an SAE that took too few steps
to be trained.

    for line in budget_lr_lines(chosen, plan, budgets): print(line)
    for line in extractor_lines(report.stats): print(line)
    for line in few_steps_warnings(report.stats): print(line, file=sys.stderr)
"""

from __future__ import annotations

from typing import Any, Mapping

MIN_SAE_STEPS = 200
"""Below this many optimiser steps an SAE is far from trained: a CLI TopK SAE fitted with
13 steps had FVU 0.76 where the same SAE with about 150 steps had 0.45."""


def budget_lr_lines(chosen: Mapping[str, float], plan: Mapping[Any, Mapping[str, Any]],
                    budgets: Mapping[str, int]) -> list[str]:
    """One line per SAE whose lr `run_config.budget_lrs` chose for the tokens it is fed (`chosen`:
    {name: lr}; `plan`: {key: {name: extractor}}; `budgets`: {name: tokens}, `run_config.entry_budget`):
    the lr, its budget and the long-run default."""
    from conceptlens.concepts.sae.config import SAEConfig

    lines = []
    for sets in plan.values():
        for name, sae in sets.items():
            if name in chosen:
                cfg = sae.config
                steps = max(1, budgets[name] // cfg.batch_size)  # as budget_lr counts them
                lines.append(f"  {name}: Adam lr {chosen[name]:.3g} for this budget (about {steps:,} steps of "
                             f"{cfg.batch_size:,} tokens; the long-run default at width {cfg.width} is "
                             f"{SAEConfig(width=cfg.width).learning_rate():.3g}); lr= in its spec sets another")
    return lines


def extractor_lines(stats: Mapping[str, Any]) -> list[str]:
    """One line per extractor: `name: FVU f, L0 l, n optimiser steps` (the figures it reports)."""
    lines = []
    for name, s in stats.items():
        if isinstance(s, dict) and "error" in s:
            lines.append(f"  {name}: not fitted ({s['error']})")
            continue
        parts = []
        fvu, l0, steps = _find(s, "fvu"), _find(s, "l0"), _find(s, "steps")
        if isinstance(fvu, float):
            parts.append(f"FVU {fvu:.3f}")
        if isinstance(l0, float):
            parts.append(f"L0 {l0:.1f}")
        if isinstance(steps, int):
            parts.append(f"{steps:,} optimiser steps")
        if parts:
            lines.append(f"  {name}: {', '.join(parts)}")
    return lines


def few_steps_warnings(stats: Mapping[str, Any]) -> list[str]:
    """A one-line warning per SAE trained with fewer than MIN_SAE_STEPS optimiser steps, with the remedy."""
    from conceptlens.concepts.sae.stats import SAEStats

    out = []
    for name, s in stats.items():
        if isinstance(s, SAEStats) and s.steps < MIN_SAE_STEPS:
            batch = f" of about {s.tokens // s.steps:,} tokens" if s.steps else ""
            out.append(f"warning: {name} got only {s.steps} optimiser steps{batch} (fewer than {MIN_SAE_STEPS}): "
                       f"it is not trained yet; give it more tokens (--max-tokens) or a smaller batch "
                       f"(batch_size= in its --extractor spec)")
    return out


def _find(stats: Any, field: str) -> Any:
    """`field` of a stats NamedTuple: its own, else its running mean's (SAEs), else a nested one's."""
    if not hasattr(stats, "_fields"):
        return None
    if field in stats._fields:
        return getattr(stats, field)
    nested = [getattr(stats, f) for f in stats._fields]
    if "mean" in stats._fields:  # an SAE's running mean over recent steps, rather than its last step
        nested.insert(0, stats.mean)
    for value in nested:
        found = _find(value, field)
        if found is not None:
            return found
    return None
