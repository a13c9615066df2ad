"""The q/k gauge group of an attention model, and random elements of it.

    t = random_gauge(model, seed=3)      # one invertible A per key head, (H_kv, d_head, d_head)
    t.inverse()                          # the inverse element

Each attention head scores with q.k; W_Q -> A W_Q, W_K -> A^-T W_K (biases b_q -> A b_q,
b_k -> A^-T b_k) leaves every score, hence every output, unchanged. One A per key head, shared
by the query heads that read it (GQA). Groups:

- "general": A = Q diag(s), Q random orthogonal, s in [1/2, 2] (condition number <= 4). A
  symmetry of models without rotary embeddings (GPT-2, BERT).
- "rotary": for each rotary pair (i, i + d_head/2) (HF's rotate_half convention) a complex
  scalar c = r e^{i phi}, r in [1/2, 2]: q -> c q, k -> k / conj(c). It commutes with every
  rotation, so it is a symmetry of rotary models too.
- "auto": "rotary" if the model has a rotary embedding, else "general". Asking for "general"
  on a rotary model is allowed on purpose: it is NOT a symmetry there and the audit shows
  the logits change (a negative control).

Supported: modules with `q_proj`/`k_proj` Linear layers and `head_dim` (Llama, Mistral, Qwen2,
Gemma, ...), GPT-2's fused `c_attn` Conv1D, BERT's `query`/`key`. Models normalising q or k
(q_norm/k_norm: Qwen3, OLMo2, Gemma3), partial or interleaved rotary, and GPT-2 cross-attention
raise NotImplementedError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

Group = Literal["auto", "general", "rotary"]
GROUPS = ("auto", "general", "rotary")
# rotary models that pair interleaved dims (2i, 2i+1) instead of (i, i + d/2)
_INTERLEAVED_ROTARY = {"gptj", "codegen", "cohere", "cohere2"}


@dataclass(frozen=True)
class GaugeTransform:
    """One random gauge element: an invertible `(d_head, d_head)` matrix per key head.

        t = random_gauge(model, seed=1); apply_gauge(model, t); apply_gauge(model, t.inverse())
    """

    matrices: dict[str, Tensor]
    """attention module name -> `(H_kv, d_head, d_head)` float64, the A of each key head"""
    group: Literal["general", "rotary"]
    seed: int

    def inverse(self) -> GaugeTransform:
        return GaugeTransform({k: torch.linalg.inv(a) for k, a in self.matrices.items()}, self.group, self.seed)


class _QKProjection:
    """One attention module's q/k weights, read and written as `(heads, d_head, d_in)` float64."""

    def __init__(self, name: str, q: nn.Linear, k: nn.Linear, d_head: int) -> None:
        self.name, self.q, self.k, self.d_head = name, q, k, d_head
        self.n_heads, self.n_kv_heads = q.out_features // d_head, k.out_features // d_head

    def params(self) -> list[Tensor]:
        return [p for m in (self.q, self.k) for p in (m.weight, m.bias) if p is not None]

    def read(self) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        def heads(m: nn.Linear) -> tuple[Tensor, Tensor | None]:
            w = m.weight.double().view(-1, self.d_head, m.in_features)
            return w, None if m.bias is None else m.bias.double().view(-1, self.d_head)

        return (*heads(self.q), *heads(self.k))

    def write(self, wq: Tensor, bq: Tensor | None, wk: Tensor, bk: Tensor | None) -> None:
        for m, w, b in ((self.q, wq, bq), (self.k, wk, bk)):
            m.weight.copy_(w.reshape(m.weight.shape))
            if b is not None:
                m.bias.copy_(b.reshape(m.bias.shape))


class _FusedConv1DQK(_QKProjection):
    """GPT-2's `c_attn`: a Conv1D with weight `(d, 3d)` (x @ W), columns q | k | v."""

    def __init__(self, name: str, c_attn: nn.Module, d_head: int) -> None:
        self.name, self.d_head = name, d_head
        self.weight, self.bias = c_attn.get_parameter("weight"), c_attn.get_parameter("bias")
        self.width = self.weight.shape[1] // 3
        self.n_heads = self.n_kv_heads = self.width // d_head

    def params(self) -> list[Tensor]:
        return [self.weight, self.bias]

    def read(self) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        w, b, d = self.weight.double(), self.bias.double(), self.width
        def heads(cols: slice) -> tuple[Tensor, Tensor]:
            return w[:, cols].T.reshape(-1, self.d_head, w.shape[0]), b[cols].view(-1, self.d_head)

        return (*heads(slice(0, d)), *heads(slice(d, 2 * d)))

    def write(self, wq: Tensor, bq: Tensor | None, wk: Tensor, bk: Tensor | None) -> None:
        d = self.width
        for cols, w_new, b_new in ((slice(0, d), wq, bq), (slice(d, 2 * d), wk, bk)):
            if b_new is None:  # read() gives both biases: a fused c_attn always has one
                raise ValueError(f"{self.name}: c_attn has a bias; the gauge must give its new value")
            self.weight[:, cols] = w_new.reshape(d, -1).T
            self.bias[cols] = b_new.reshape(-1)


def _model_type(model: nn.Module) -> str:
    return getattr(getattr(model, "config", None), "model_type", type(model).__name__)


def _projection(name: str, m: nn.Module, model_type: str) -> _QKProjection | None:
    """The q/k projections of module `m` if it is an attention module we know, else None."""
    q_proj, k_proj = getattr(m, "q_proj", None), getattr(m, "k_proj", None)
    if isinstance(q_proj, nn.Linear) and isinstance(k_proj, nn.Linear) and hasattr(m, "head_dim"):
        if hasattr(m, "q_norm") or hasattr(m, "k_norm"):
            raise NotImplementedError(
                f"{model_type}: {name} normalises q/k (q_norm/k_norm); a gauge of W_Q/W_K would change "
                "the normalised vectors, and the smaller group the norm leaves is not implemented"
            )
        return _QKProjection(name, q_proj, k_proj, _int_attr(m, "head_dim"))
    query, key = getattr(m, "query", None), getattr(m, "key", None)
    if isinstance(query, nn.Linear) and isinstance(key, nn.Linear) and hasattr(m, "attention_head_size"):
        return _QKProjection(name, query, key, _int_attr(m, "attention_head_size"))
    c_attn = getattr(m, "c_attn", None)
    if isinstance(c_attn, nn.Module) and type(c_attn).__name__ == "Conv1D" and hasattr(m, "head_dim"):
        if getattr(m, "is_cross_attention", False):
            raise NotImplementedError(f"{model_type}: cross-attention {name} (split q_attn/c_attn) is not supported")
        return _FusedConv1DQK(name, c_attn, _int_attr(m, "head_dim"))
    return None


def _int_attr(m: nn.Module, name: str) -> int:
    """A plain int attribute of a module (a head size): nn.Module's attribute typing knows only
    parameters, buffers and submodules."""
    return int(getattr(m, name))


def _projections(model: nn.Module) -> list[_QKProjection]:
    model_type = _model_type(model)
    found = [p for name, m in model.named_modules() if (p := _projection(name, m, model_type)) is not None]
    if not found:
        raise NotImplementedError(
            f"{type(model).__name__} ({model_type}): no supported attention found; the gauge audit knows "
            "q_proj/k_proj + head_dim (Llama family), GPT-2 c_attn and BERT query/key"
        )
    return found


def _is_rotary(model: nn.Module) -> bool:
    if not any("rotary" in type(m).__name__.lower() for m in model.modules()):
        return False
    config, model_type = getattr(model, "config", None), _model_type(model)
    if model_type in _INTERLEAVED_ROTARY:
        raise NotImplementedError(f"{model_type} pairs interleaved rotary dims; only rotate_half pairing is supported")
    rope = getattr(config, "rope_parameters", None)
    rope = rope if isinstance(rope, dict) else {}
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if factor not in (None, 1.0):
        raise NotImplementedError(f"{model_type} rotates only part of each head (partial_rotary_factor={factor})")
    return True


def _log_uniform(shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
    """Scales in [1/2, 2], log-uniform: random but well conditioned."""
    return torch.exp((2 * torch.rand(shape, generator=gen, dtype=torch.float64) - 1) * math.log(2))


def _random_general(n: int, d: int, gen: torch.Generator) -> Tensor:
    """`(n, d, d)`: random orthogonal times a positive diagonal."""
    q, r = torch.linalg.qr(torch.randn(n, d, d, generator=gen, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]  # Haar, not QR's sign bias
    return q * _log_uniform((n, 1, d), gen)


def _random_rotary(n: int, d: int, gen: torch.Generator) -> Tensor:
    """`(n, d, d)`: per pair (i, i + d/2) the 2x2 matrix of multiplication by r e^{i phi}."""
    half = d // 2
    r = _log_uniform((n, half), gen)
    phi = 2 * math.pi * torch.rand(n, half, generator=gen, dtype=torch.float64)
    a, b = r * torch.cos(phi), r * torch.sin(phi)
    out = torch.zeros(n, d, d, dtype=torch.float64)
    i = torch.arange(half)
    out[:, i, i], out[:, i, i + half], out[:, i + half, i], out[:, i + half, i + half] = a, -b, b, a
    return out


def random_gauge(model: nn.Module, seed: int = 0, group: Group = "auto") -> GaugeTransform:
    """A random element of the model's q/k gauge group (see the module docstring for groups).

        t = random_gauge(model, seed=3)      # group "rotary" for Llama, "general" for GPT-2
    """
    if group not in GROUPS:
        raise ValueError(f"group must be one of {GROUPS}; got {group!r}")
    projections = _projections(model)
    rotary = _is_rotary(model) if group != "general" else False
    chosen: Literal["general", "rotary"] = "rotary" if group == "rotary" or (group == "auto" and rotary) else "general"
    gen = torch.Generator().manual_seed(seed)
    sample = _random_rotary if chosen == "rotary" else _random_general
    matrices = {p.name: sample(p.n_kv_heads, p.d_head, gen) for p in projections}
    return GaugeTransform(matrices, chosen, seed)
