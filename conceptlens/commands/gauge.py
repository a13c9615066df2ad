"""`conceptlens gauge`: gauge-invariant attention geometry of one layer, then a gauge audit.

    conceptlens gauge --model smollm2-135m --layer 10 --data bbc-news --max-tokens 20000

Streams query/key second moments of the layer through `lens.fit` (no activations kept),
prints per key head the metrics the q/k gauge cannot move, next to a raw key cosine that
it can, and finally moves the model along a random gauge element and prints which metrics
moved with it (`conceptlens.metrics.gauge_audit`). A model that normalises q and k per head
(Gemma-3, Qwen3) gets the table and, before the pass, one line on why the audit is left out.
"""

from __future__ import annotations

import argparse
import math
from itertools import chain, islice
from typing import Any, NamedTuple

import torch
from torch import Tensor

from conceptlens.commands._args import data_source, positive_int, seed, token_length
from conceptlens.metrics.gauge import QueryKeyMoments, key_cosine, key_distance, qk_spectrum, score_cosine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="registered name, hub id or local folder")
    parser.add_argument("--layer", type=int, default=10, help="block index (negative counts from the end)")
    parser.add_argument("--data", type=data_source, default="bbc-news", help="bundled set name, .txt or .jsonl path")
    parser.add_argument("--max-tokens", type=positive_int, default=20_000, help="tokens streamed into the q/k moments")
    parser.add_argument("--max-length", type=token_length, default=128, help="tokens per document")
    parser.add_argument("--pairs", type=positive_int, default=4000, help="random key pairs for the distance statistics")
    parser.add_argument("--sample-docs", type=positive_int, default=8,
                        help="documents whose keys are paired and on which the audit runs")
    parser.add_argument("--group", choices=("auto", "general", "rotary"), default="auto",
                        help="gauge group of the audit ('general' on a rotary model is a negative control)")
    parser.add_argument("--seed", type=seed, default=0)


class HeadTable(NamedTuple):
    """Per key head summaries, each `(H_kv,)`; every column but `raw_cosine` is gauge-invariant."""

    group_size: int
    """query heads per key head"""
    spectrum_rank: Tensor
    """exp(entropy) of the normalised eigenvalues of S_q S_k: how many q/k directions carry scores"""
    top_share: Tensor
    """largest eigenvalue of S_q S_k over their sum"""
    rms_score: Tensor
    """scaling * sqrt(tr(S_q S_k) / g): rms of the score q.k * scaling (the model's, 1 / sqrt(d_head)
    unless it sets another) over (query, key) token pairs and the g query heads of the group"""
    distance_mean: Tensor
    """mean key_distance over random key pairs"""
    distance_median: Tensor
    cosine_mean: Tensor
    """mean score_cosine over the same pairs"""
    cosine_std: Tensor
    raw_cosine: Tensor
    """mean plain key cosine over the same pairs (NOT invariant, for contrast)"""


def head_table(moments: QueryKeyMoments, keys: Tensor, n_pairs: int, seed: int = 0,
               scaling: float | None = None) -> HeadTable:
    """Summarise a layer's heads from streamed moments and a sample of keys `(N, H_kv, d_head)`.

        table = head_table(moments, k, n_pairs=4000, scaling=attention.scaling)

    Pairs (i, j), i != j, are drawn uniformly with a generator seeded by `seed`. `scaling` is the
    factor the model multiplies q.k by (None: 1 / sqrt(d_head); Gemma's is query_pre_attn_scalar^-0.5).
    """
    if len(keys) < 2:
        raise ValueError(f"need at least two keys to pair; got {len(keys)}")
    spec = qk_spectrum(moments.S_q, moments.S_k)  # (H_kv, d_head), descending
    p = spec / spec.sum(-1, keepdim=True)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    gen = torch.Generator().manual_seed(seed)
    i = torch.randint(len(keys), (n_pairs,), generator=gen)
    j = (i + torch.randint(1, len(keys), (n_pairs,), generator=gen)) % len(keys)  # never i
    k1, k2 = keys[i].double(), keys[j].double()
    dist = key_distance(k1, k2, moments.S_q)  # (P, H_kv)
    cos = score_cosine(k1, k2, moments.S_q)
    g = moments.group_size
    scaling = moments.d_head ** -0.5 if scaling is None else scaling
    return HeadTable(g, entropy.exp(), spec[:, 0] / spec.sum(-1), (spec.sum(-1) / g).sqrt() * scaling,
                     dist.mean(0), dist.median(0).values, cos.mean(0), cos.std(0), key_cosine(k1, k2).mean(0))


def format_table(table: HeadTable) -> str:
    g = table.group_size
    head = (f"{'key head':>8} {'q heads':>8} {'QK rank':>8} {'top eig':>8} {'rms score':>10} "
            f"{'dist mean':>10} {'dist med':>10} {'scos mean':>10} {'scos std':>9} | {'raw cos':>7}")
    rows = [f"{h:>8} {f'{h * g}-{h * g + g - 1}':>8} {table.spectrum_rank[h]:8.2f} {table.top_share[h]:8.3f} "
            f"{table.rms_score[h]:10.3f} {table.distance_mean[h]:10.3f} {table.distance_median[h]:10.3f} "
            f"{table.cosine_mean[h]:10.3f} {table.cosine_std[h]:9.3f} | {table.raw_cosine[h]:7.3f}"
            for h in range(len(table.rms_score))]
    return "\n".join([head, *rows])


LEGEND = (
    ("QK rank", "count, 1..d_head", "exp(entropy) of the normalised eigenvalues of S_q S_k: how many q/k "
                                    "directions carry the scores"),
    ("top eig", "fraction, 0..1", "largest eigenvalue of S_q S_k over their sum"),
    ("rms score", "logits", "root mean square of the score q.k times the model's scaling (1 / sqrt(d_head) "
                            "unless it sets another) over (query, key) token pairs and the group's query heads"),
    ("dist mean", "logits^2", "mean over key pairs of (k1 - k2)^T S_q (k1 - k2) / d_head: the mean squared "
                              "score change when k1 replaces k2, summed over the group's query heads"),
    ("dist med", "logits^2", "median of the same"),
    ("scos mean", "cosine, -1..1", "mean over key pairs of the keys' cosine under S_q: how alike their score "
                                   "profiles are"),
    ("scos std", "cosine", "standard deviation of the same"),
    ("raw cos", "cosine, -1..1", "plain cosine of the two keys; NOT gauge-invariant, shown for contrast"),
)
"""(column, unit, one-line definition) of `format_table`; S_q = E[q q^T] summed over the query heads of a
key head, S_k = E[k k^T]."""


def format_legend() -> str:
    """The columns of `format_table`: unit and definition, one line each."""
    width = max(len(name) for name, _, _ in LEGEND)
    unit_width = max(len(unit) for _, unit, _ in LEGEND)
    lines = ["columns (per key head; S_q = E[q q^T] summed over its query heads, S_k = E[k k^T]):"]
    lines += [f"  {name:<{width}}  {unit:<{unit_width}}  {text}" for name, unit, text in LEGEND]
    return "\n".join(lines)


def sample_batch(tokenizer: Any, texts: list[str], max_length: int) -> dict[str, Tensor]:
    """Right-padded batch of `texts` (a pad token is borrowed from eos when the tokenizer has none)."""
    if getattr(tokenizer, "pad_token", None) is None and getattr(tokenizer, "eos_token", None) is not None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return dict(tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=max_length))


def sample_keys(lens: Any, site: str, batch: dict[str, Tensor]) -> Tensor:
    """Keys `(N, H_kv, d_head)` of the batch's real tokens, each sequence's first token left out
    (the attention sink, as in fits)."""
    with lens.capture(site) as cap:
        acts, meta = cap.forward(**batch)
    return acts[site][meta.position > 0]


def run(args: argparse.Namespace) -> int:
    import conceptlens
    from conceptlens import data
    from conceptlens._checks import check_memory
    from conceptlens.commands._common import load_model
    from conceptlens.metrics.capture_qk import qk_capture
    from conceptlens.metrics.gauge_audit import gauge_audit
    from conceptlens.metrics.gauge_group import random_gauge

    for name in ("max_tokens", "pairs", "sample_docs", "max_length"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer; got {getattr(args, name)}")
    model, tok = load_model(args)
    lens = conceptlens.attach(model, tok)
    q_site, k_site = lens.site(f"blocks.{args.layer}.attn.q").name, lens.site(f"blocks.{args.layer}.attn.k").name
    width = math.prod(int(s) for s in lens.site(k_site).shape[2:])
    check_memory(f"--pairs {args.pairs}", args.pairs * (16 + 2 * 4 * width))  # two indices, two key rows per pair
    print(f"{lens}\n  {lens.site(q_site).describe()}\n  {lens.site(k_site).describe()}\n")
    try:  # before the pass: a model whose gauge cannot be applied to its weights gets the table, not the audit
        random_gauge(model, seed=args.seed, group=args.group)
        left_out = None
    except NotImplementedError as err:
        left_out = f"gauge audit left out: {err}"
        print(f"{left_out}\n")

    stream = data.iter_texts(args.data)
    texts = list(islice(stream, args.sample_docs))  # also the first documents of the fit: one read of the source
    moments = QueryKeyMoments()
    report = lens.fit({(q_site, k_site): moments}, chain(texts, stream), max_tokens=args.max_tokens,
                      max_length=args.max_length)
    print(report.summary())

    batch = sample_batch(tok, texts, args.max_length)
    table = head_table(moments, sample_keys(lens, k_site, batch), args.pairs, args.seed,
                       scaling=getattr(lens.site(q_site).module, "scaling", None))
    print(f"\nblock {q_site.split('.')[1]}: {moments.n_q:,} queries streamed; {args.pairs:,} random key pairs "
          f"from {len(texts)} documents (scos = score cosine; only 'raw cos' depends on the gauge)")
    print(format_table(table))
    print(format_legend())

    if left_out is not None:
        print(f"\n{left_out}")
        return 0
    layer = int(q_site.split(".")[1])
    audit = gauge_audit(model, batch, capture_qk=qk_capture(layers=[layer]), seed=args.seed, group=args.group)
    print(f"\n{audit}")
    return 0
