"""Attention geometry that the query/key gauge cannot move, and the raw geometry it can.

    moments = QueryKeyMoments()
    for q, k in stream:                       # q: (N, H, d_head), k: (N, H_kv, d_head)
        moments.update(q, k)
    d2 = key_distance(k1, k2, moments.S_q)    # (..., H_kv): mean squared score change

A head scores q.k = x_i^T W_Q^T W_K x_j. Replacing W_Q -> A W_Q and W_K -> A^-T W_K changes no
output (with rotary embeddings A must commute with the rotations), so raw key norms, key
cosines and key PCA describe the chosen A as much as the model. The invariant quantities
measure keys through the queries that read them: S_q = E[q q^T] turns a key difference into
the score change it causes, and S_q -> A S_q A^T exactly cancels k -> A^-T k.

Grouped-query attention (H = g * H_kv; query head h reads key head h // g, the HF
convention): `S_q` of key head j is the SUM over its g query heads of E[q_h q_h^T]. So
`key_distance` is the sum over those g heads of each head's mean squared score change, i.e.
g times the mean over all (token, query head) pairs of the group; with g = 1 it is exactly
the mean squared change of the scaled score q.k / sqrt(d_head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from conceptlens._checks import check_int
from conceptlens.concepts.base import ExtractorBase, NotFittedError


def _as_heads(x: Tensor, name: str) -> Tensor:
    """`(..., H, d_head)` -> `(N, H, d_head)` in float64 (sums over long streams stay exact)."""
    if x.ndim < 2:
        raise ValueError(f"{name} must have shape (..., heads, d_head); got {tuple(x.shape)}")
    return x.reshape(-1, *x.shape[-2:]).double()


@dataclass
class QKMomentsConfig:
    """Settings of `QueryKeyMoments`."""

    n_kv_heads: int | None = None
    """If given, checked against the keys' head count."""

    def __post_init__(self) -> None:
        check_int("n_kv_heads", self.n_kv_heads, optional=True)


class QKMomentsStats(NamedTuple):
    n_q: int
    """Query tokens summed."""
    n_k: int
    """Key tokens summed."""


class QueryKeyMoments(ExtractorBase):
    """Streamed second moments of queries and keys, per head, for gauge-invariant metrics.

        m = QueryKeyMoments(); m.update(q, k); m.S_q   # (H_kv, d_head, d_head)

    Holds sufficient statistics (float64 sums and counts), so `merge` of two workers (objects
    or state dicts) equals one run over the union of their data. q and k may have different
    token counts (cross-attention). `n_kv_heads`, if given, is checked against the keys' head count.
    """

    Config = QKMomentsConfig
    method = "qk_moments"
    distributed = "merge"

    def __init__(self, n_kv_heads: int | None = None, *, device: str | torch.device | None = None) -> None:
        self.config = QKMomentsConfig(n_kv_heads)
        self._set_device(device)
        self.n_kv_heads = n_kv_heads
        self.n_q = 0
        self.n_k = 0
        self.sum_qq: Tensor | None = None  # (H, d_head, d_head), per query head
        self.sum_kk: Tensor | None = None  # (H_kv, d_head, d_head)
        self.sum_q: Tensor | None = None  # (H, d_head)
        self.sum_k: Tensor | None = None  # (H_kv, d_head)

    def _check_shapes(self, q: Tensor, k: Tensor) -> None:
        (_, h, dq), (_, h_kv, dk) = q.shape, k.shape
        if dq != dk:
            raise ValueError(f"q and k must share d_head; got q {tuple(q.shape)}, k {tuple(k.shape)}")
        if self.n_kv_heads is not None and h_kv != self.n_kv_heads:
            raise ValueError(f"k has {h_kv} heads but n_kv_heads={self.n_kv_heads}")
        if h % h_kv:
            raise ValueError(f"query heads ({h}) must be a multiple of key heads ({h_kv})")
        if self.sum_qq is None:
            return
        sum_qq, sum_kk, _, _ = self._sums()
        if (sum_qq.shape[0], sum_kk.shape[0], self.d_head) != (h, h_kv, dq):
            raise ValueError(
                f"got (H={h}, H_kv={h_kv}, d_head={dq}) but earlier batches had "
                f"(H={sum_qq.shape[0]}, H_kv={sum_kk.shape[0]}, d_head={self.d_head})"
            )

    def update(self, q: Tensor, k: Tensor) -> None:
        """Add queries `(..., H, d_head)` and keys `(..., H_kv, d_head)` (leading dims flattened)."""
        q, k = self._place(_as_heads(q, "q")), self._place(_as_heads(k, "k"))
        self._check_shapes(q, k)
        qq = torch.einsum("nha,nhb->hab", q, q)
        kk = torch.einsum("nha,nhb->hab", k, k)
        if self.sum_qq is None:
            self.sum_qq, self.sum_kk = qq, kk
            self.sum_q, self.sum_k = q.sum(0), k.sum(0)
        else:
            for total, part in zip(self._sums(), (qq, kk, q.sum(0), k.sum(0))):
                total.add_(part)
        self.n_q += q.shape[0]
        self.n_k += k.shape[0]

    def _sums(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(sum_qq, sum_kk, sum_q, sum_k), all set by the first update."""
        if self.sum_qq is None or self.sum_kk is None or self.sum_q is None or self.sum_k is None:
            raise NotFittedError("QueryKeyMoments has seen no data; call update(q, k) first")
        return self.sum_qq, self.sum_kk, self.sum_q, self.sum_k

    @property
    def d_head(self) -> int:
        return self._sums()[0].shape[-1]

    @property
    def group_size(self) -> int:
        """g: query heads per key head."""
        sum_qq, sum_kk, _, _ = self._sums()
        return sum_qq.shape[0] // sum_kk.shape[0]

    @property
    def S_q_per_head(self) -> Tensor:
        """E[q q^T] per query head, `(H, d_head, d_head)` float64."""
        return self._sums()[0] / self.n_q

    @property
    def S_q(self) -> Tensor:
        """E[q q^T] summed over the query heads sharing each key head, `(H_kv, d_head, d_head)`."""
        s = self.S_q_per_head
        return s.view(-1, self.group_size, *s.shape[1:]).sum(1)

    @property
    def S_k(self) -> Tensor:
        """E[k k^T] per key head, `(H_kv, d_head, d_head)` float64."""
        return self._sums()[1] / self.n_k

    @property
    def mean_q(self) -> Tensor:
        """`(H, d_head)` float64."""
        return self._sums()[2] / self.n_q

    @property
    def mean_k(self) -> Tensor:
        """`(H_kv, d_head)` float64."""
        return self._sums()[3] / self.n_k

    def stats(self) -> QKMomentsStats:
        return QKMomentsStats(self.n_q, self.n_k)

    def flush(self) -> None:
        """Nothing is held back."""

    def state_dict(self) -> dict[str, Any]:
        return {"config": self.config_dict(), "n_q": self.n_q, "n_k": self.n_k,
                "sum_qq": self.sum_qq, "sum_kk": self.sum_kk, "sum_q": self.sum_q, "sum_k": self.sum_k}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        state = self._placed(state)
        self.n_q, self.n_k = int(state["n_q"]), int(state["n_k"])
        for key in ("sum_qq", "sum_kk", "sum_q", "sum_k"):
            value = state[key]
            setattr(self, key, None if value is None else value.clone())

    def merge(self, other: QueryKeyMoments | dict[str, Any]) -> None:
        """Add another worker's sums (an object or its state dict, whatever its `n_kv_heads`):
        the result equals one run over both streams."""
        theirs = QueryKeyMoments.from_state(other) if isinstance(other, dict) else other
        if not isinstance(theirs, QueryKeyMoments):
            raise TypeError(f"can only merge a QueryKeyMoments with another; got {type(theirs).__name__}")
        self._merge(theirs)

    def _merge(self, other: QueryKeyMoments) -> None:
        if other.sum_qq is None:
            return
        if self.sum_qq is None:
            self.load_state_dict({**other.state_dict(), "config": self.config_dict()})
            return
        mine, theirs = self._sums(), other._sums()
        if theirs[0].shape != mine[0].shape or theirs[1].shape != mine[1].shape:
            raise ValueError(
                f"cannot merge moments of shapes {tuple(theirs[0].shape)}/{tuple(theirs[1].shape)} "
                f"into {tuple(mine[0].shape)}/{tuple(mine[1].shape)}"
            )
        for total, part in zip(mine, theirs):
            total.add_(part.to(mine[0].device))
        self.n_q += other.n_q
        self.n_k += other.n_k


def _common(*xs: Tensor) -> list[Tensor]:
    dtype = xs[0].dtype
    for x in xs[1:]:
        dtype = torch.promote_types(dtype, x.dtype)
    return [x.to(dtype) for x in xs]


def _quad(u: Tensor, S: Tensor, v: Tensor) -> Tensor:
    """u^T S v per head: u, v `(..., H, d)`, S `(H, d, d)` -> `(..., H)`."""
    return torch.einsum("...ha,hab,...hb->...h", u, S, v)


def key_distance(k1: Tensor, k2: Tensor, S_q: Tensor) -> Tensor:
    """Squared key distance seen by the queries: (k1 - k2)^T S_q (k1 - k2) / d_head.

        d2 = key_distance(k[:, 3], k[:, 7], moments.S_q)

    k1, k2: `(..., H_kv, d_head)`; S_q: `(H_kv, d_head, d_head)`; returns `(..., H_kv)` in the
    promoted dtype. Equals the mean over the streamed queries of (q.k1 - q.k2)^2 / d_head,
    summed over the query heads sharing the key head (see the module docstring).
    """
    k1, k2, S_q = _common(k1, k2, S_q)
    diff = k1 - k2
    return _quad(diff, S_q, diff) / S_q.shape[-1]


def score_cosine(k1: Tensor, k2: Tensor, S_q: Tensor) -> Tensor:
    """Cosine of two keys under the S_q inner product: how alike their score profiles are.

        c = score_cosine(k1, k2, moments.S_q)      # (..., H_kv), in [-1, 1]

    = E[(q.k1)(q.k2)] / sqrt(E[(q.k1)^2] E[(q.k2)^2]) over the streamed queries.
    """
    k1, k2, S_q = _common(k1, k2, S_q)
    return _quad(k1, S_q, k2) / (_quad(k1, S_q, k1) * _quad(k2, S_q, k2)).sqrt()


def qk_spectrum(S_q: Tensor, S_k: Tensor) -> Tensor:
    """Eigenvalues of S_q S_k per head, descending: the gauge-invariant query/key spectrum.

        spec = qk_spectrum(m.S_q, m.S_k)      # (H_kv, d_head), real and >= 0

    Under the gauge S_q S_k -> A S_q S_k A^-1, a similar matrix. Computed as the eigenvalues of
    the symmetric S_q^1/2 S_k S_q^1/2 (same spectrum, numerically stable).
    """
    S_q, S_k = _common(S_q, S_k)
    evals, evecs = torch.linalg.eigh(S_q)
    root = evecs @ torch.diag_embed(evals.clamp_min(0).sqrt()) @ evecs.transpose(-1, -2)
    sym = root @ S_k @ root
    return torch.linalg.eigvalsh((sym + sym.transpose(-1, -2)) / 2).flip(-1).clamp_min(0)


def qk_singular_values(W_q: Tensor, W_k: Tensor) -> Tensor:
    """Singular values of the bilinear form W_Q^T W_K of each head (biases and rotary ignored).

        sv = qk_singular_values(Wq.view(H, d_head, d), Wk.view(H, d_head, d))   # (H, d_head)

    W_q, W_k: `(H, d_head, d_model)` in nn.Linear layout (for GQA repeat W_k to the query heads).
    Invariant since (A W_Q)^T (A^-T W_K) = W_Q^T W_K. Uses QR factors: the (d, d) product has
    the singular values of the small (d_head, d_head) matrix R_q R_k^T.
    """
    W_q, W_k = _common(W_q, W_k)
    r_q = torch.linalg.qr(W_q.transpose(-1, -2)).R  # (H, d_head, d_head)
    r_k = torch.linalg.qr(W_k.transpose(-1, -2)).R
    return torch.linalg.svdvals(r_q @ r_k.transpose(-1, -2))


# Raw metrics: NOT invariant under the gauge; kept to show what the audit catches.

def key_cosine(k1: Tensor, k2: Tensor) -> Tensor:
    """Plain cosine of keys `(..., H, d_head)` -> `(..., H)`; gauge-dependent."""
    return torch.nn.functional.cosine_similarity(k1, k2, dim=-1)


def key_norm(k: Tensor) -> Tensor:
    """Euclidean key norms `(..., H, d_head)` -> `(..., H)`; gauge-dependent."""
    return k.norm(dim=-1)


def key_pca_explained(k: Tensor, r: int) -> Tensor:
    """Explained-variance ratio of the top-r principal components of centred keys, per head.

        ratios = key_pca_explained(k, r=4)     # k: (N, H, d_head) -> (H, r); gauge-dependent
    """
    if not 1 <= r <= k.shape[-1]:
        raise ValueError(f"r must be in 1..d_head={k.shape[-1]}; got {r}")
    dtype, k = k.dtype, _as_heads(k, "k")
    centred = (k - k.mean(0)).transpose(0, 1)  # (H, N, d_head)
    var = torch.linalg.svdvals(centred) ** 2  # (H, min(N, d_head)), descending
    return (var[:, :r] / var.sum(-1, keepdim=True)).to(dtype)
