"""Shared pieces of `run_all.py`: result rows, the loaded model, timing, the machine."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class Row:
    """One line of the final table: a measurement and its ratio to the section's reference."""

    section: str
    name: str
    value: str
    ratio: float | None = None
    reference: str = ""
    goal: str = ""


@dataclass
class Context:
    quick: bool
    device: torch.device
    rows: list[Row] = field(default_factory=list)
    _model: Any = None

    def model(self):
        """SmolLM2-135M fp32 (and its tokenizer), loaded once, on the chosen device."""
        if self._model is None:
            from conceptlens import models

            model, tok = models.load("smollm2-135m")
            self._model = (model.to(self.device), tok)
        return self._model

    def add(self, section: str, name: str, value: str, ratio: float | None = None, reference: str = "",
            goal: str = "") -> None:
        row = Row(section, name, value, ratio, reference, goal)
        self.rows.append(row)
        ratio_text = f"{ratio:7.3f}x {reference}" if ratio is not None else ""
        print(f"  {name:<52s} {value:>22s}  {ratio_text}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"{gpu}, Python {platform.python_version()}")


def gemm_flops(device: torch.device, n: int = 4096, d: int = 576, k: int = 4096, repeats: int = 5) -> float:
    """FLOP/s of an fp32 (n, d) @ (d, k) matmul, the product k-means and SAEs are made of."""
    a, b = torch.randn(n, d, device=device), torch.randn(d, k, device=device)
    a @ b
    best = min(timed(lambda: a @ b, device) for _ in range(repeats))
    return 2 * n * d * k / best
