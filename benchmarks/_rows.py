"""Block-15 residual rows of SmolLM2 over BBC News, captured once and cached (benchmarks only)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

CACHE = Path(os.environ.get("CONCEPTLENS_BENCH_CACHE", Path.home() / ".cache" / "conceptlens-bench"))


def block15_rows(n_rows: int, max_length: int = 256, split: str = "all") -> torch.Tensor:
    """`(n_rows, 576)` float32 rows of the bbc-news `split`: padding, first positions and
    >10x-median-norm rows dropped, shuffled with seed 0. Cached under $CONCEPTLENS_BENCH_CACHE
    (never in the repository)."""
    name = "bbc" if split == "all" else f"bbc-{split}"
    path = CACHE / f"smollm2-block15-{name}-{n_rows}-{max_length}.pt"
    if path.is_file():
        return torch.load(path, weights_only=True)
    import conceptlens
    from conceptlens import data, models

    texts = data.load("bbc-news", split=split).texts
    texts = texts[::7] + [t for i, t in enumerate(texts) if i % 7]  # spread over the five topics first
    model, tok = models.load("smollm2-135m")
    lens = conceptlens.attach(model, tok)
    rows, count = [], 0
    with torch.inference_mode(), lens.capture("blocks.15.resid_out") as cap:  # stops after block 15
        for i in range(0, len(texts), 8):
            batch = tok(texts[i:i + 8], return_tensors="pt", padding=True, truncation=True, max_length=max_length)
            captured, meta = cap.forward(**batch)
            acts = captured["blocks.15.resid_out"][meta.position > 0]
            norms = acts.norm(dim=1)
            rows.append(acts[norms < 10 * norms.median()])
            count += rows[-1].shape[0]
            if count >= n_rows:
                break
    x = torch.cat(rows).clone()
    if x.shape[0] < n_rows:
        raise RuntimeError(f"only {x.shape[0]} rows captured; wanted {n_rows}")
    x = x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))][:n_rows].contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(x, path.with_suffix(".partial"))
    path.with_suffix(".partial").rename(path)
    return x
