"""SmolLM2 blocks.15.resid_out rows over every bundled text set, captured once for `peers.py`.

    python benchmarks/peers_rows.py [--split train|test] [--cache DIR] [--window 512]

The train split of all four bundled sets (bbc-news, movie-polarity, wsj-pos,
conll2010-uncertainty: about 1.09M tokens) is cut into windows of at most `--window` tokens;
the model runs in bf16 by default (about 2x faster here than fp32; rows differ from an fp32
capture by about 1% of their norm); each window is one sequence, its position 0 (the attention sink), padding, and rows over 10x
the batch's median norm dropped. Rows are written as float16 shards of about 33k rows under
`--cache` (default $CONCEPTLENS_PEERS_CACHE or /work/cache/peers-rows; never the repository),
so an interrupted capture resumes at the next unwritten shard. `load_rows` reads them back
shuffled with a fixed seed.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

SITE = "blocks.15.resid_out"
SETS = ("bbc-news", "movie-polarity", "wsj-pos", "conll2010-uncertainty")
CACHE = Path(os.environ.get("CONCEPTLENS_PEERS_CACHE", "/work/cache/peers-rows"))
SHARD_TOKENS = 32768  # window tokens per shard (rows kept are a few fewer)
BATCH_TOKENS = 4096  # padded tokens per forward
BUCKET = 64  # sequence lengths are padded to a multiple of this


def windows(tok, split: str, window: int) -> list[list[int]]:
    """Every text of every set in `split`, tokenised whole and cut into `window`-token pieces
    (pieces under 2 tokens dropped: position 0 is never kept), in a seeded random order (so a
    capture cut short still samples every set)."""
    import random

    from conceptlens import data

    pieces = []
    for name in SETS:
        for ids in tok(data.load(name, split=split).texts)["input_ids"]:
            pieces += [ids[i:i + window] for i in range(0, len(ids), window) if len(ids) - i >= 2]
    random.Random(0).shuffle(pieces)
    return pieces


def shards(pieces: list[list[int]]) -> list[list[list[int]]]:
    """Consecutive groups of pieces of about SHARD_TOKENS tokens each, each sorted by length to spare padding."""
    out: list[list[list[int]]] = [[]]
    size = 0
    for p in pieces:
        if size >= SHARD_TOKENS:
            out.append([])
            size = 0
        out[-1].append(p)
        size += len(p)
    return [sorted(g, key=len) for g in out]


@torch.inference_mode()
def capture_shard(lens, tok, pieces: list[list[int]]) -> torch.Tensor:
    """float16 rows of SITE over `pieces`, about BATCH_TOKENS padded tokens per forward. Lengths
    are padded to a multiple of BUCKET so that few distinct shapes reach the kernels (with one
    shape per batch, the CPU's bf16 kernel caches grew by gigabytes within a shard)."""
    buckets: dict[int, list[list[int]]] = {}
    for p in pieces:
        buckets.setdefault(-(-len(p) // BUCKET) * BUCKET, []).append(p)
    rows = []
    with lens.capture(SITE) as cap:  # stops after block 15
        for length, group in buckets.items():
            n = max(1, BATCH_TOKENS // length)
            for i in range(0, len(group), n):
                batch = tok.pad({"input_ids": group[i:i + n]}, pad_to_multiple_of=BUCKET, return_tensors="pt")
                captured, meta = cap.forward(**batch)
                acts = captured[SITE][meta.position > 0]
                norms = acts.norm(dim=1)
                rows.append(acts[norms < 10 * norms.median()].half())
    return torch.cat(rows)


def capture(split: str, window: int, cache: Path, dtype: torch.dtype) -> None:
    import conceptlens
    from conceptlens import models

    model, tok = models.load("smollm2-135m")
    lens = conceptlens.attach(model.to(dtype), tok)
    groups = shards(windows(tok, split, window))
    folder = cache / f"{split}-{window}"
    folder.mkdir(parents=True, exist_ok=True)
    print(f"{split}: {sum(len(p) for g in groups for p in g)} tokens in {len(groups)} shards -> {folder}", flush=True)
    start = time.perf_counter()
    for j, group in enumerate(groups):
        path = folder / f"shard-{j:03d}.pt"
        if path.is_file():
            continue
        x = capture_shard(lens, tok, group)
        torch.save(x, path.with_suffix(".partial"))
        path.with_suffix(".partial").rename(path)
        print(f"  shard {j + 1}/{len(groups)}: {x.shape[0]} rows, {time.perf_counter() - start:.0f} s", flush=True)
    (folder / "DONE").write_text(f"{len(groups)} shards\n")


def load_rows(split: str = "train", window: int = 512, cache: Path = CACHE, limit: int | None = None,
              complete: bool = True) -> torch.Tensor:
    """The captured rows (float16, `(N, 576)`), shuffled with seed 0; the first `limit` of them.
    `complete=False` also takes a capture still under way (the shards written so far)."""
    folder = cache / f"{split}-{window}"
    if complete and not (folder / "DONE").is_file():
        raise FileNotFoundError(f"no complete capture in {folder}; make it once with:\n"
                                f"    python benchmarks/peers_rows.py --split {split} --window {window}")
    parts = sorted(folder.glob("shard-*.pt"))
    if not parts:
        raise FileNotFoundError(f"no shards in {folder}")
    x = torch.cat([torch.load(p, weights_only=True) for p in parts])
    x = x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))]
    return x[:limit].contiguous() if limit else x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=("train", "test"), default="train")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the model's dtype for the capture (bf16: about 2x faster on this CPU's AMX)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    capture(args.split, args.window, args.cache, getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
