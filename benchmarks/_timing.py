"""Side-by-side timing helpers for the benchmark scripts (not part of the package)."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def median_seconds(fn: Callable[[], object], repeats: int = 7, warmup: int = 2) -> float:
    """Median wall time of `fn()` over `repeats` runs, after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved(fns: dict[str, Callable[[], object]], rounds: int = 7, warmup: int = 1) -> dict[str, float]:
    """Median seconds of each function, timed in interleaved rounds so drift hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def print_table(title: str, seconds: dict[str, float], baseline: str, tokens: int | None = None) -> None:
    print(f"\n{title}")
    base = seconds[baseline]
    for name, s in seconds.items():
        rate = f"  {tokens / s:10.0f} tok/s" if tokens else ""
        print(f"  {name:<40s} {s * 1e3:9.1f} ms  {s / base:6.3f}x{rate}")
