"""`short_budget_lr`: Gao et al.'s width rule times a multiple that falls with the steps of a known
budget and grows with the batch, checked against hand-computed values."""

from __future__ import annotations

import pytest

from conceptlens.concepts.sae import TopKSAE
from conceptlens.concepts.sae.config import SAEConfig, short_budget_lr


@pytest.mark.parametrize("width, steps, batch, expected", [
    (16384, 250, 3840, 2e-4 * 8 * 0.9375),  # sqrt(16000 / 250) = 8; 3840 / (3840 + 256) = 0.9375
    (16384, 1000, 768, 2e-4 * 4 * 0.75),  # sqrt(16) = 4; 768 / 1024
    (4096, 10, 256, 4e-4 * 16 * 0.5),  # sqrt(1600) = 40, capped at 16; Gao at width 4096: 2e-4 * 2
    (4096, 1, 1_000_000, 4e-4 * 16 * 1_000_000 / 1_000_256),
    (16384, 16000, 4096, 2e-4),  # 1 * 4096 / 4352 < 1: never below Gao's rule
    (16384, 10**9, 64, 2e-4),
])
def test_values_by_hand(width, steps, batch, expected):
    assert short_budget_lr(width, steps, batch) == pytest.approx(expected, rel=1e-12)


def test_the_multiple_falls_with_the_steps_and_grows_with_the_batch():
    lrs = [short_budget_lr(2304, s, 4096) for s in (100, 250, 1000, 4000, 16000)]  # below ~62 steps: capped
    assert all(a > b for a, b in zip(lrs, lrs[1:])) and lrs[-1] == SAEConfig(width=2304).learning_rate()
    by_batch = [short_budget_lr(2304, 250, b) for b in (128, 1024, 4096)]
    assert by_batch == sorted(by_batch)


def test_a_directly_built_sae_keeps_gaos_rule():
    sae = TopKSAE(width=4096, k=8)
    assert sae.config.learning_rate() == pytest.approx(4e-4, rel=1e-12)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, None])
def test_bad_values_are_named(bad):
    with pytest.raises(ValueError, match=f"steps must be a positive integer; got {bad!r}"):
        short_budget_lr(2304, bad, 4096)
