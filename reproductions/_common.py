"""Shared helpers of the reproduction scripts: offline activations (cached), embeddings, timing.

Activations are read once per (model, task, split, site, size) and cached under
reproductions/.cache (git-ignored), so the scripts that share inputs do not recompute them.
Everything is offline: the registered models (smollm2-135m, minilm-l6) and data sets.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
CACHE = ROOT / ".cache"


class Split(NamedTuple):
    x: Tensor
    """`(M, d)` activations of the probed units (document means, or tokens)"""
    y: Tensor
    """`(M,)` labels"""


def threads(n: int = 2) -> None:
    torch.set_num_threads(n)


def _key(**kwargs: Any) -> Path:
    digest = hashlib.sha1(json.dumps(kwargs, sort_keys=True).encode()).hexdigest()[:16]
    return CACHE / f"{kwargs['model']}-{kwargs['task']}-{kwargs['split']}-{digest}.pt"


@torch.no_grad()
def activations(model: str, task: str, split: str, site: str, max_docs: int = 300, max_length: int = 64,
                max_classes: int = 10, seed: int = 0) -> Split:
    """Probe units of `task` at `site`: document means (bbc-news, movie-polarity) or first
    sub-tokens of words (wsj-pos, the `max_classes` most frequent tags), as `conceptlens eval` reads them."""
    path = _key(model=model, task=task, split=split, site=site, max_docs=max_docs, max_length=max_length,
                max_classes=max_classes, seed=seed)
    if path.is_file():
        return Split(**torch.load(path, weights_only=True))
    import conceptlens
    from conceptlens import data, models
    from conceptlens.evaluate.activations import collect, label_ids, label_of, pick, task_batches

    m, tok = models.load(model)
    lens = conceptlens.attach(m, tok)
    token_level = task == "wsj-pos"
    train_set = data.load(task, "train")
    tag_ids, _ = label_ids(train_set, token_level, max_classes)
    texts = data.load(task, split)
    picked = pick(len(texts), max_docs, seed)
    batches = task_batches(tok, [texts.texts[i] for i in picked], [label_of(texts, i, token_level) for i in picked],
                           token_level=token_level, tag_ids=tag_ids, batch_size=16, max_length=max_length)
    features = collect(lens, site, {}, batches)
    out = {"x": features.x.float(), "y": features.y.long()}
    CACHE.mkdir(exist_ok=True)
    torch.save(out, path)
    return Split(**out)


@torch.no_grad()
def token_rows(model: str, texts: list[str], site: str, max_length: int = 64, batch_size: int = 16) -> tuple[Tensor, Tensor]:
    """Per-token activations `(T, d)` at `site` for `texts` (attention-sink first token dropped),
    and the text each token came from `(T,)`."""
    import conceptlens
    from conceptlens import models
    from conceptlens.batching import encode_batch

    m, tok = models.load(model)
    lens = conceptlens.attach(m, tok)
    xs, rows = [], []
    with lens.capture(site) as cap:
        for start in range(0, len(texts), batch_size):
            batch = encode_batch(tok, texts[start:start + batch_size], max_length)
            acts, meta = cap.forward(**batch)
            x = acts[site].flatten(1).float()
            inner = meta.position > 0
            xs.append(x[inner])
            rows.append(meta.row[inner] + start)
    return torch.cat(xs), torch.cat(rows)


@torch.no_grad()
def minilm_embeddings(texts: list[str], batch_size: int = 64) -> Tensor:
    """Mean-pooled MiniLM sentence embeddings `(len(texts), 384)`, unit norm (sentence-transformers' recipe)."""
    from conceptlens import models
    from conceptlens.batching import encode_batch

    m, tok = models.load("minilm-l6")
    out = []
    for start in range(0, len(texts), batch_size):
        batch = encode_batch(tok, texts[start:start + batch_size], 128)
        h = m(**batch).last_hidden_state
        mask = batch["attention_mask"][..., None].float()
        out.append(torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=1))
    return torch.cat(out)


def cached(name: str, fn: Any, **kwargs: Any) -> Any:
    """`fn(**kwargs)`, cached under reproductions/.cache by name and arguments."""
    path = CACHE / f"{name}-{hashlib.sha1(json.dumps(kwargs, sort_keys=True).encode()).hexdigest()[:16]}.pt"
    if path.is_file():
        return torch.load(path, weights_only=True)
    value = fn(**kwargs)
    CACHE.mkdir(exist_ok=True)
    torch.save(value, path)
    return value


class Clock:
    """Wall-clock seconds since creation, for the scripts' reports."""

    def __init__(self) -> None:
        self.start = time.time()

    def __str__(self) -> str:
        return f"{time.time() - self.start:.0f} s"


def report(title: str, rows: list[tuple], header: tuple) -> None:
    """Print a small aligned table."""
    print(f"\n## {title}")
    widths = [max(len(str(h)), *(len(_fmt(r[i])) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(str(h).ljust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(_fmt(v).ljust(w) for v, w in zip(r, widths)))


def _fmt(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


# ---- extractors fitted on an in-memory sample (the paper's setting: one representation per sample) ----

def fit_deleuzian(x: Tensor, k: int, *, mode: str = "paper", skew_weighting: bool = True, seed: int = 0) -> Tensor:
    """Concepts `(k, d)` of Deleuzian on the rows of x, streamed in chunks of 1024."""
    from conceptlens.concepts.deleuzian import Deleuzian

    kwargs: dict[str, Any] = {"skew_weighting": skew_weighting, "seed": seed}
    if mode == "paper":
        kwargs.update(mode="paper", max_differences=max(len(x), 1), reference_size=max(len(x), 1))
    dz = Deleuzian(k, **kwargs)
    for chunk in x[torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))].split(1024):
        dz.update(chunk)
    dz.flush()
    return dz.centroids


def fit_topk(x: Tensor, width: int, k: int, *, epochs: int = 20, seed: int = 0) -> Any:
    """A TopK SAE trained on `epochs` shuffled passes over the rows of x."""
    from conceptlens.concepts.sae import TopKSAE

    batch = min(256, max(16, len(x) // 8))
    sae = TopKSAE(width=width, k=k, batch_size=batch, warmup_tokens=min(len(x), 1024), seed=seed,
                  dead_after=max(10 * len(x), 1000), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for chunk in x[torch.randperm(len(x), generator=g)].split(1024):
            sae.update(chunk)
    sae.flush()
    return sae


def sae_pre_activations(sae: Any, x: Tensor) -> Tensor:
    """(x - b_dec) W_enc + b_enc in raw units: the dense codes the Deleuzian paper probes for SAEs."""
    raw = sae._raw()
    return (x.float() - raw["b_dec"]) @ raw["W_enc"] + raw["b_enc"]


# (name, model, task, site, documents per split, Deleuzian concepts): the probe and MPPC tables
DELEUZIAN_TASKS = [
    ("SmolLM2 bbc-news (doc means)", "smollm2-135m", "bbc-news", "blocks.15.resid_out", 300, 256),
    ("MiniLM bbc-news (doc means)", "minilm-l6", "bbc-news", "blocks.5.resid_out", 300, 256),
    ("SmolLM2 wsj-pos (tokens)", "smollm2-135m", "wsj-pos", "blocks.15.resid_out", 200, 512),
]


def deleuzian_tasks(only: list[str]):
    """(name, train, test, k) for each task whose name contains a word of `only` (all when empty)."""
    for name, model, task, site, docs, k in DELEUZIAN_TASKS:
        if only and not any(word in name for word in only):
            continue
        train = activations(model, task, "train", site, max_docs=docs)
        test = activations(model, task, "test", site, max_docs=docs // 2)
        yield name, train, test, k
