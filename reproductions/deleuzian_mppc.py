"""Claim (Deleuzian, 000): concepts are consistent across runs (MPPC), more than an SAE's.

Paper (DINOv2 / ImageNet): MPPC 0.789 for Deleuzian vs 0.588 / 0.603 for SAEs.

    python reproductions/deleuzian_mppc.py           # about 6 minutes on 2 cores

MPPC (metrics.quality.mppc): z-score each run's concept activations on the test units,
R = Za^T Zb / N, MPPC = mean_j max_i R_ij: the mean over run b's concepts of the best correlation
in run a. Two seeds of each
method on the same training units: Deleuzian (paper mode; the seed changes pairing and
k-means++), a TopK SAE (8x the width, k = 32; probed on its codes).
"""

from __future__ import annotations

import sys

from _common import Clock, deleuzian_tasks, fit_deleuzian, fit_topk, report, threads

from conceptlens.metrics.quality import mppc


def main() -> None:
    threads(2)
    clock, rows = Clock(), []
    only = sys.argv[1:]  # e.g. "MiniLM": run the tasks whose name contains one of these words
    for name, train, test, k in deleuzian_tasks(only):
        d = train.x.shape[1]
        Ca, Cb = (fit_deleuzian(train.x, k, seed=s) for s in (0, 1))
        dz = mppc(test.x @ Ca.T, test.x @ Cb.T)
        sa, sb = (fit_topk(train.x, 8 * d, 32, epochs=20 if len(train.y) < 5000 else 4, seed=s) for s in (0, 1))
        za, zb = sa.encode(test.x), sb.encode(test.x)
        alive = (za != 0).any(0), (zb != 0).any(0)  # a never-firing latent has no z-score
        sae = mppc(za[:, alive[0]], zb[:, alive[1]])
        rows.append((name, k, dz, 8 * d, sae))
        print(f"[{clock}] {name}: Deleuzian {dz:.3f}, TopK SAE {sae:.3f}", flush=True)
    report("MPPC between two seeds (1 = every concept has a twin)", rows,
           ("task", "Deleuzian k", "Deleuzian MPPC", "SAE width", "TopK SAE MPPC"))
    print(f"\ntotal {clock}")


if __name__ == "__main__":
    main()
