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


def site_rows(lens, site: str, docs: list[str]) -> list:
    """The batches of rows `lens.fit` gives an extractor at `site` over `docs` (batch 8, length 128)."""
    keep = _Rows()
    lens.fit({site: keep}, docs, batch_size=8, max_length=128, progress=False)
    return keep.rows


def encoder_floor(rows: list, width: int, k: int, rounds: int, device) -> float:
    """Best seconds of a TopK SAE's encoder forward alone (pre-activations x @ W_enc.T + b, then
    top-k) over the batches `rows` a fit sees (`site_rows`): what any exact TopK step computes at
    least once per row, whatever its backward costs (2 N d width FLOP)."""
    d = rows[0].shape[1]
    g = torch.Generator().manual_seed(0)
    w_enc = (torch.randn(width, d, generator=g) / d ** 0.5).to(device)
    b_enc = torch.zeros(width, device=device)

    def encode():
        for x in rows:
            torch.addmm(b_enc, x, w_enc.T).topk(k, dim=1)

    encode()
    return min(timed(encode, device) for _ in range(max(rounds, 3)))


def ready_codebook(rows: list, n_codes: int):
    """A maker of VQ codebooks already initialised on `rows` (all of them, in one k-means++ and
    Lloyd): each fit with one takes EMA steps from its first batch, so its row times the steps
    alone, apart from the initialisation."""
    import copy

    from conceptlens.concepts.vq import VQCodebook

    n = sum(len(x) for x in rows)
    ready = VQCodebook(n_codes=n_codes, init_size=n)
    ready.update(torch.cat(rows))  # exactly init_size rows: the initialisation, no step
    state = ready.state_dict()
    return lambda: VQCodebook.from_state(copy.deepcopy(state))
