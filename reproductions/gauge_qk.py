"""Claim (group action, 004): key norms, cosines and PCA at q/k sites are not model properties;
the query-weighted metrics are; representation similarities ignore exactly their declared group.

Paper: under W_Q -> A W_Q, W_K -> A^-T W_K the model is unchanged while raw key geometry moves;
d^2 = (k1 - k2)^T Sigma_q (k1 - k2) / d_k, cosine under Sigma_q and the spectrum of Sigma_q Sigma_k
are invariant. (A qualitative claim: no table in the paper.)

    python reproductions/gauge_qk.py                 # about 2 minutes on 2 cores

1. SmolLM2 (rotary): a random element of the rotary gauge group (commutes with the rotations,
   so it is a symmetry) and, as a negative control, of the general linear group (not a
   symmetry of a rotary model: the logits must move), on 8 bbc-news texts, every layer.
2. `group_audit` of CKA, CCA, SVCCA, Procrustes and mutual k-NN between MiniLM block 2 and
   block 5 document means, under random isometries, similarities and affine maps.
"""

from __future__ import annotations

import torch

from _common import Clock, activations, threads


def main() -> None:
    threads(2)
    clock = Clock()
    import conceptlens
    from conceptlens import data, models
    from conceptlens.batching import encode_batch
    from conceptlens.metrics.gauge_audit import gauge_audit
    from conceptlens.metrics.similarity import group_audit

    model, tok = models.load("smollm2-135m")
    conceptlens.attach(model, tok)
    texts = data.load("bbc-news", "test").texts[:8]
    inputs = encode_batch(tok, texts, 64)
    for group in ("rotary", "general"):
        print(f"\n[{clock}] " + str(gauge_audit(model, inputs, seed=1, group=group)), flush=True)
    a = activations("minilm-l6", "bbc-news", "train", "blocks.2.resid_out", max_docs=200).x
    b = activations("minilm-l6", "bbc-news", "train", "blocks.5.resid_out", max_docs=200).x
    report = group_audit(a.double(), b.double(), trials=4, seed=0, rtol=1e-6)
    print(f"\n[{clock}] group audit of representation similarities, MiniLM block 2 vs block 5 document means "
          f"({len(a)} documents); max relative change over 4 random elements:\n{report}\n"
          f"declared invariances hold: {report.consistent}")
    print(f"\ntotal {clock}")


if __name__ == "__main__":
    main()
