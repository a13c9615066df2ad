"""Claim (hierarchies, 002): only the activation-nested Matryoshka (ActMSAE) builds deep concept
hierarchies; MP-SAE builds no graph under the co-activation protocol.

Paper (CLIP ViT-L/14 on CC3M, width 6144, CCA protocol): TopK 2120 nodes, depth 3.67, s_ha .986,
s_ss .750, s_rf .162, s_ad .621, s_cc .257, s_ai .914; ActMSAE 3341 nodes, depth 5.67, s_ha .763,
s_ss .800, s_rf .476; ArchMSAE depth 3.00; EWG depth 2.67; MP-SAE no graph.

    python reproductions/hierarchy_depth.py          # about 15 minutes on 2 cores

SmolLM2 block 5 tokens of bbc-news sentences (one sentence per sequence, up to 48 tokens);
e(x) = the MiniLM sentence embedding of the token's sentence (the independent embedding s_m
and s_ss need). Each SAE: width 1152 (2x), 3 passes over 40k tokens; TopK k = 8, ArchMSAE
(our MatryoshkaSAE) k = 8 with prefixes 72 .. 1152, ActMSAE k = 8 with levels 8, 32, 128, 1152
(weights 4..1), MP-SAE 8 steps, EWG-SAE (4 groups). Graph and scores: metrics.hierarchy +
metrics.hierarchy_eval with the paper's defaults (top 64, threshold 0.9, 20-firing floor, 5
descendants, hubs above 5% of the width), on 24k held-out tokens (3000 sentences in all).
"""

from __future__ import annotations

import torch

from _common import Clock, cached, minilm_embeddings, report, threads, token_rows

from conceptlens.concepts.sae import MatryoshkaSAE, TopKSAE
from conceptlens.concepts.sae.mpsae import MPSAE
from conceptlens.concepts.sae.nested import ActMSAE, EWGSAE
from conceptlens.metrics.hierarchy import CoactivationStats, build_dag
from conceptlens.metrics.hierarchy_eval import hierarchy_scores

WIDTH, K = 1152, 8
COMMON = dict(width=WIDTH, batch_size=512, warmup_tokens=2048, dead_after=200_000, lr=1e-3, seed=0)
MODELS = {
    "TopK": lambda: TopKSAE(**COMMON, k=K),
    "ArchMSAE": lambda: MatryoshkaSAE(**COMMON, k=K, prefixes=(72, 144, 288, 576, 1152)),
    "ActMSAE": lambda: ActMSAE(**COMMON, k=K, ks=(8, 32, 128, 1152), encode_k=64),
    "MP-SAE": lambda: MPSAE(**COMMON, k=K),
    "EWG-SAE": lambda: EWGSAE(**COMMON, groups=(144, 288, 576, 1152), l1=3.0),
}


def _sentences(n: int) -> list[str]:
    from conceptlens import data

    out = []
    for text in data.load("bbc-news", "train").texts:
        out += [s.strip() + "." for s in text.replace("\n", " ").split(". ") if len(s.split()) >= 6]
    order = torch.randperm(len(out), generator=torch.Generator().manual_seed(0)).tolist()
    return [out[i] for i in order[:n]]


def _inputs(n: int) -> dict:
    sentences = _sentences(n)
    x, row = token_rows("smollm2-135m", sentences, "blocks.5.resid_out", max_length=48)
    return {"x": x, "row": row, "emb": minilm_embeddings(sentences)}


def main() -> None:
    threads(2)
    clock, rows = Clock(), []
    data = cached("hierarchy-inputs", _inputs, n=3000)
    x, e = data["x"], data["emb"][data["row"]]
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(x), generator=g)
    n_held = min(24_000, len(x) // 3)
    train, held = order[:-n_held][:40_000], order[-n_held:]
    print(f"[{clock}] {len(x)} tokens ({len(train)} train, {len(held)} held out), d = {x.shape[1]}", flush=True)
    for name, make in MODELS.items():
        sae = make()
        for _ in range(3):
            for chunk in x[train[torch.randperm(len(train), generator=g)]].split(4096):
                sae.update(chunk)
        sae.flush()
        z = torch.cat([sae.encode(c) for c in x[held].split(2048)])
        stats = CoactivationStats(WIDTH)
        stats.update(z)
        dag = build_dag(stats)
        s = hierarchy_scores(dag, z, e[held])
        fvu = float((x[held] - sae.decode(z)).pow(2).sum() / (x[held] - x[held].mean(0)).pow(2).sum())
        rows.append((name, s.nodes, s.edges, s.depth, s.s_m, s.s_ha, s.s_ss, s.s_ai, s.s_ad, s.s_rf, s.s_cc, fvu))
        print(f"[{clock}] {name}: {s.row()}  FVU {fvu:.3f}", flush=True)
    report("concept hierarchies (CCA protocol) on SmolLM2 block 5", rows,
           ("SAE", "nodes", "edges", "depth", "s_m", "s_ha", "s_ss", "s_ai", "s_ad", "s_rf", "s_cc", "FVU"))
    print(f"\ntotal {clock}")


if __name__ == "__main__":
    main()
