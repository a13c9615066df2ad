"""Gauge audit: move a model along its query/key symmetry and see which metrics move with it.

    report = gauge_audit(model, inputs)      # q/k read at the blocks.{i}.attn.q/.k sites
    print(report)               # logits diff, then each metric's relative change
    report.moved()              # ['key_cosine', 'key_norm', 'key_pca']: not properties of the model

Each attention head scores with q.k; W_Q -> A W_Q, W_K -> A^-T W_K (biases b_q -> A b_q,
b_k -> A^-T b_k) leaves every score, hence every output, unchanged. The groups of such A
("general", "rotary", "auto") and the supported models are described in `gauge_group`,
which draws the random elements; this module applies them and compares the metrics. The
audit never leaves the model changed: `gauged` restores the original q/k parameters bit for bit.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import Tensor, nn

from conceptlens.metrics.capture_qk import QKCapture, qk_capture
from conceptlens.metrics.gauge import (QueryKeyMoments, key_cosine, key_distance, key_norm, key_pca_explained,
                                       qk_spectrum, score_cosine)
from conceptlens.metrics.gauge_group import GaugeTransform, Group, _projections, random_gauge
from conceptlens.metrics.gauge_group import GROUPS as GROUPS  # re-exported, importable from here as before


# Metrics a gauge audit compares before and after a gauge: (q, k) of one layer -> a tensor.
AuditMetric = Callable[[Tensor, Tensor], Tensor]


def _key_pairs(k: Tensor, m: int = 64) -> tuple[Tensor, Tensor]:
    """All pairs i < j among the first m keys: two `(P, H_kv, d_head)` tensors."""
    i, j = torch.triu_indices(min(len(k), m), min(len(k), m), offset=1)
    return k[i], k[j]


def _moments(q: Tensor, k: Tensor) -> QueryKeyMoments:
    moments = QueryKeyMoments()
    moments.update(q, k)
    return moments


AUDIT_METRICS: dict[str, AuditMetric] = {
    "key_norm": lambda q, k: key_norm(k),
    "key_cosine": lambda q, k: key_cosine(*_key_pairs(k)),
    "key_pca": lambda q, k: key_pca_explained(k, r=min(4, k.shape[-1])),
    "key_distance": lambda q, k: key_distance(*_key_pairs(k), _moments(q, k).S_q),
    "score_cosine": lambda q, k: score_cosine(*_key_pairs(k), _moments(q, k).S_q),
    "qk_spectrum": lambda q, k: qk_spectrum(_moments(q, k).S_q, _moments(q, k).S_k),
}
"""Built-in audited metrics; q: `(N, H, d_head)`, k: `(N, H_kv, d_head)` of the same tokens.
The first three are gauge-dependent, the last three invariant."""


@torch.no_grad()
def apply_gauge(model: nn.Module, transform: GaugeTransform) -> None:
    """Transform the model's q/k weights in place; `apply_gauge(model, t.inverse())` undoes it
    up to rounding (use `gauged` for an exact restore)."""
    projections = {p.name: p for p in _projections(model)}
    if projections.keys() != transform.matrices.keys():
        raise ValueError(f"transform is for attention modules {sorted(transform.matrices)}; model has {sorted(projections)}")
    for name, A in transform.matrices.items():
        p = projections[name]
        if A.shape != (p.n_kv_heads, p.d_head, p.d_head):
            raise ValueError(f"{name}: A has shape {tuple(A.shape)}, expected {(p.n_kv_heads, p.d_head, p.d_head)}")
        wq, bq, wk, bk = p.read()
        A = A.to(wq.device)
        A_inv_t = torch.linalg.inv(A).transpose(-1, -2)
        A_q = A.repeat_interleave(p.n_heads // p.n_kv_heads, dim=0)  # query head h uses key head h // g
        p.write(A_q @ wq, None if bq is None else (A_q @ bq[..., None])[..., 0],
                A_inv_t @ wk, None if bk is None else (A_inv_t @ bk[..., None])[..., 0])


@contextlib.contextmanager
def gauged(model: nn.Module, transform: GaugeTransform) -> Iterator[nn.Module]:
    """Apply a gauge inside the block; the original q/k parameters come back bit for bit.

        with gauged(model, random_gauge(model)):
            logits = model(**inputs).logits
    """
    params = [t for p in _projections(model) for t in p.params()]
    saved = [t.detach().clone() for t in params]
    try:
        apply_gauge(model, transform)
        yield model
    finally:
        with torch.no_grad():
            for t, s in zip(params, saved):
                t.copy_(s)


@dataclass(frozen=True)
class AuditReport:
    """What one random gauge element moved. Print it for a table.

        report.logits_max_abs_diff      # ~1e-6: the gauge is a symmetry of this model
        report.moved(tol=1e-3)          # metrics that are not properties of the model
    """

    logits_max_abs_diff: float
    """max |output after - output before| (logits, or last hidden state for encoders)"""
    logits_max_abs: float
    """max |output| before the gauge, the scale to read the difference against"""
    relative_change: dict[str, float]
    """metric -> max over layers of |m_after - m_before| / |m_before| (Frobenius norms)"""
    per_layer: dict[str, dict[Any, float]] = field(repr=False)
    """metric -> layer -> relative change"""
    group: str
    seed: int

    def moved(self, tol: float = 1e-3) -> list[str]:
        return [name for name, change in self.relative_change.items() if change > tol]

    def __str__(self) -> str:
        head = (f"gauge audit ({self.group}, seed {self.seed}): output max |diff| {self.logits_max_abs_diff:.2e} "
                f"(max |output| {self.logits_max_abs:.2e})")
        rows = [f"  {name:<16}{change:10.2e}  {'moved' if change > 1e-3 else 'invariant'}"
                for name, change in self.relative_change.items()]
        return "\n".join([head, *rows])


def _output(model: nn.Module, inputs: Mapping[str, Any]) -> Tensor:
    out = model(**inputs)
    for name in ("logits", "last_hidden_state"):
        if getattr(out, name, None) is not None:
            return getattr(out, name)
    return out[0]


def _tokens(x: Tensor, mask: Tensor | None) -> Tensor:
    """`(B, T, H, d_head)` -> `(N, H, d_head)`, dropping padded positions when a mask fits."""
    if mask is not None and x.ndim == 4 and tuple(x.shape[:2]) == tuple(mask.shape):
        return x[mask.bool()]
    return x.reshape(-1, *x.shape[-2:])


def _run(model: nn.Module, inputs: Mapping[str, Any], capture_qk: QKCapture) -> tuple[Tensor, dict]:
    with torch.no_grad():
        output = _output(model, inputs).double()
        captured = capture_qk(model, inputs)
    mask = inputs.get("attention_mask")
    return output, {layer: (_tokens(q, mask), _tokens(k, mask)) for layer, (q, k) in captured.items()}


def _relative_change(before: Tensor, after: Tensor) -> float:
    before, after = before.double(), after.double()
    return ((after - before).norm() / before.norm()).item()


def gauge_audit(
    model: nn.Module,
    inputs: Mapping[str, Any],
    capture_qk: QKCapture | None = None,
    metrics: Mapping[str, AuditMetric] | None = None,
    seed: int = 0,
    group: Group = "auto",
) -> AuditReport:
    """Run the model before and after a random gauge; report the output change and each
    metric's relative change per layer. The model comes back unchanged (weights and modes).

        report = gauge_audit(model, tok(texts, return_tensors="pt"))

    `capture_qk`: `(model, inputs) -> {layer: (q, k)}`; default `qk_capture()`, every block's
    `attn.q` / `attn.k` site (pass `qk_capture(layers=[...])` to audit fewer blocks).
    `metrics` maps names to `(q (N, H, d_head), k (N, H_kv, d_head)) -> Tensor`; default
    `AUDIT_METRICS` (key norm, key cosine, key PCA, key distance, score cosine, QK spectrum).
    """
    metrics = dict(AUDIT_METRICS if metrics is None else metrics)
    capture_qk = qk_capture() if capture_qk is None else capture_qk
    transform = random_gauge(model, seed=seed, group=group)
    modes = {m: m.training for m in model.modules()}
    model.eval()  # dropout would differ between the two runs
    try:
        output, before = _run(model, inputs, capture_qk)
        with gauged(model, transform):
            output_gauged, after = _run(model, inputs, capture_qk)
    finally:
        for m, training in modes.items():
            m.training = training
    if before.keys() != after.keys() or not before:
        raise RuntimeError(f"capture_qk returned layers {sorted(before, key=str)} then {sorted(after, key=str)}")
    per_layer = {name: {layer: _relative_change(f(*before[layer]), f(*after[layer])) for layer in before}
                 for name, f in metrics.items()}
    return AuditReport(
        logits_max_abs_diff=(output_gauged - output).abs().max().item(),
        logits_max_abs=output.abs().max().item(),
        relative_change={name: max(changes.values()) for name, changes in per_layer.items()},
        per_layer=per_layer,
        group=transform.group,
        seed=seed,
    )
