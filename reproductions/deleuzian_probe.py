"""Claim (Deleuzian, 000): probe loss Deleuzian < best SAE, and the place of LDA, sentence- and token-level.

Paper (CLIP-WikiArt-Genre, DINOv2-WikiArt-Style, BART-CoNLL-POS): Deleuzian / best SAE / LDA
0.1230 / 0.1360 / 0.0976, 0.0137 / 0.0144 / 0.0101, 0.0639 / 0.1647 / 0.3875; Deleuzian wins
13 of 20 tasks.

    python reproductions/deleuzian_probe.py          # about 10 minutes on 2 cores (first run reads activations)

Probe loss (metrics.quality.probe_loss, the paper's protocol): per class, the concept whose
1-D logistic probe has the lowest train log-loss, scored by its test log-loss; median over
classes. Sentence level: bbc-news document means (5 topics) of SmolLM2 block 15 and MiniLM
block 5. Token level: wsj-pos first sub-tokens (10 most frequent tags) of SmolLM2 block 15.
Deleuzian runs in the paper's mode (all differences, skewness over all samples, full k-means)
and in the streaming mode (the default, what `fit` and the CLI use);
the TopK SAE (8x the width, k = 32) is probed on its sparse codes and, as the paper's code does,
on its dense pre-activations.
"""

from __future__ import annotations

import sys

import torch

from _common import Clock, deleuzian_tasks, fit_deleuzian, fit_topk, report, sae_pre_activations, threads

from conceptlens.metrics.quality import lda_directions, probe_loss


def main() -> None:
    threads(2)
    clock, rows = Clock(), []
    only = sys.argv[1:]  # e.g. "MiniLM": run the tasks whose name contains one of these words
    for name, train, test, k in deleuzian_tasks(only):
        d = train.x.shape[1]
        print(f"[{clock}] {name}: {len(train.y)} train / {len(test.y)} test units, d = {d}", flush=True)
        C = fit_deleuzian(train.x, k)
        dz = probe_loss(train.x @ C.T, train.y, test.x @ C.T, test.y).loss
        C = fit_deleuzian(train.x, k, mode="streaming")  # what `fit` and the CLI use
        dz_stream = probe_loss(train.x @ C.T, train.y, test.x @ C.T, test.y).loss
        sae = fit_topk(train.x, 8 * d, 32, epochs=20 if len(train.y) < 5000 else 4)
        sparse = probe_loss(sae.encode(train.x), train.y, sae.encode(test.x), test.y).loss
        dense = probe_loss(sae_pre_activations(sae, train.x), train.y, sae_pre_activations(sae, test.x), test.y).loss
        lda = lda_directions(train.x, train.y).directions.float()
        lda_loss = probe_loss(train.x @ lda.T, train.y, test.x @ lda.T, test.y).loss
        rows.append((name, k, dz, dz_stream, sparse, dense, lda_loss))
        print(f"[{clock}]   Deleuzian {dz:.4f} (streaming {dz_stream:.4f})  TopK codes {sparse:.4f}  TopK pre-acts {dense:.4f}  LDA {lda_loss:.4f}",
              flush=True)
    report("probe loss (test log-loss of the best single concept, median over classes; lower is better)", rows,
           ("task", "k", "Deleuzian (paper)", "Deleuzian (streaming)", "TopK SAE codes", "TopK SAE pre-acts", "LDA"))
    print(f"\ntotal {clock}")


if __name__ == "__main__":
    main()
