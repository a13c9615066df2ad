"""The least a fit can cost: math every exact method must do on the fit's own rows, timed alone."""

from __future__ import annotations

import torch

from _suite import timed


class _Rows:
    """An extractor that keeps every batch of rows it is given (to time math on the fit's own rows)."""

    def __init__(self):
        self.rows = []

    def update(self, x):
        self.rows.append(x.clone())

    def state_dict(self):
        return {}


def encoder_floor(lens, site: str, docs: list[str], width: int, k: int, rounds: int, device) -> float:
    """Best seconds of a TopK SAE's encoder forward alone (pre-activations x @ W_enc.T + b, then
    top-k) over the rows the fit at `site` sees, batch by batch: what any exact TopK step computes
    at least once per row, whatever its backward costs."""
    keep = _Rows()
    lens.fit({site: keep}, docs, batch_size=8, max_length=128, progress=False)
    d = keep.rows[0].shape[1]
    g = torch.Generator().manual_seed(0)
    w_enc = (torch.randn(width, d, generator=g) / d ** 0.5).to(device)
    b_enc = torch.zeros(width, device=device)

    def encode():
        for x in keep.rows:
            torch.addmm(b_enc, x, w_enc.T).topk(k, dim=1)

    encode()
    return min(timed(encode, device) for _ in range(max(rounds, 3)))
