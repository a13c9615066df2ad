"""The q/k/v, pattern and z sites of one attention sublayer (a mixin of `Adapter`).

Attention that calls the attention-function interface gets q/k/v as passed to it (after rotary
embedding) and a pattern site; keys that are the tokens' followed by others are split
(`keys.py`); hand-written attention gets q/k/v from its projections, or parts of one fused
projection (`fused.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from conceptlens.adapters import families
from conceptlens.adapters.block_view import BlockView
from conceptlens.adapters.fused import describe, fused_layout
from conceptlens.adapters.keys import add_split_attention, key_layout
from conceptlens.adapters.probe_pass import Trace
from conceptlens.adapters.repeated import projection_view
from conceptlens.adapters.verify import call_of
from conceptlens.adapters.verify import submodule as _get

_Q_NAMES = ("q_proj", "query", "q", "query_proj", "q_lin", "project_q")
_K_NAMES = ("k_proj", "key", "k", "key_proj", "k_lin", "project_k")
_V_NAMES = ("v_proj", "value", "v", "value_proj", "v_lin", "project_v")


def _first_attr(obj: object, names: tuple[str, ...]) -> Any:
    """The first of `names` that `obj` has and is not None (None: none); its type is the model's."""
    return next((getattr(obj, n) for n in names if getattr(obj, n, None) is not None), None)


def projection_owner(attn: nn.Module, names: tuple[str, ...]) -> nn.Module:
    """`attn`, or its one child that owns the q projection (a wrapper around the attention)."""
    if any(hasattr(getattr(attn, n, None), "weight") for n in names):
        return attn
    owners = [c for c in attn.children() if any(hasattr(getattr(c, n, None), "weight") for n in names)]
    return owners[0] if len(owners) == 1 else attn


def head_layout(attn: nn.Module, config) -> tuple[int, int, int] | None:
    """(query heads, key/value heads, head dim) of an attention module with projections, or
    None when neither the module nor the config tells (no q/k/v sites then)."""
    head_dim = _first_attr(attn, ("head_dim", "attention_head_size", "key_value_proj_dim", "d_kv", "dim_per_head", "dim_head"))
    heads = _first_attr(attn, ("num_heads", "num_attention_heads", "n_heads", "n_head"))
    q, k = _first_attr(attn, _Q_NAMES), _first_attr(attn, _K_NAMES)
    heads = heads or getattr(config, "num_attention_heads", 1)
    width = getattr(q, "out_features", None) or getattr(config, "hidden_size", None)
    if head_dim:
        head_dim = int(head_dim)
    elif width:
        head_dim = int(width // heads)
    else:
        return None
    width = getattr(q, "out_features", None)
    if width:
        heads = width // head_dim
    kv_heads = k.out_features // head_dim if hasattr(k, "out_features") else heads
    return int(heads), int(kv_heads), head_dim


def in_width(module: nn.Module) -> int:
    weight = getattr(module, "weight", None)
    if hasattr(module, "in_channels"):  # a 1x1 Conv1d projection (SqueezeBERT)
        return int(getattr(module, "in_channels"))
    if hasattr(module, "in_features"):
        return int(getattr(module, "in_features"))
    if weight is not None and weight.ndim == 2:
        # Conv1D (GPT-2) stores (in, out); Linear stores (out, in)
        return int(weight.shape[0] if type(module).__name__ == "Conv1D" else weight.shape[1])
    return -1


class AttentionSites:
    """Adds an attention sublayer's sites through the adapter's `_add` (see adapter.py)."""

    model_type: str  # the adapter's (its model's `config.model_type`)
    config: Any  # the model's transformers config (its class varies with the model)
    problems: dict[str, str]
    _view: BlockView

    if TYPE_CHECKING:  # the adapter's methods this mixin calls (adapter.py defines them)
        def _what(self) -> str: ...

        def _add(self, name: str, module: nn.Module, point, shape, stack: str, source: str, heads=None,
                 flat_in=None, scale: float = 1.0, plus: nn.Module | None = None, view: BlockView | None = None,
                 part=None, row_offset: int = 0, inner=None, expand=None, resid: bool = False) -> None: ...

    def _add_attention(self, name: str, block: nn.Module, path: str | None, z_path: str | None, q_stack: str,
                       kv_stack: str, trace: Trace, notes: str) -> None:
        attn = _get(block, path)
        if attn is None:
            return
        call = call_of(trace, attn)
        seq_kv = "T" if kv_stack == q_stack else "S"
        suffix = f"; {notes}" if notes else ""
        split = key_layout(attn, call, trace, q_stack) if seq_kv == "T" else None  # T5Gemma2, DeepSeek V4
        if split is None and call is not None and seq_kv == "T" and call.k_len != call.q_len:  # no cache here
            for which in ("q", "k", "v", "pattern"):  # e.g. T5Gemma2's merged self- and cross-attention
                self.problems[f"{name}.{which}"] = (f"{self._what()}: {type(attn).__name__} attends {call.q_len} "
                                                    f"queries to {call.k_len} keys in a forward without cache, so "
                                                    "its keys are not this stack's tokens (merged attention)")
            return
        if split is not None and call is not None:  # key_layout gives a split only for a call
            heads, v_dim = add_split_attention(self, name, attn, call, split, q_stack, suffix)
        elif call is not None:
            shapes = {"q": ("B", "T", call.heads, call.head_dim), "k": ("B", seq_kv, call.kv_heads, call.head_dim),
                      "v": ("B", seq_kv, call.kv_heads, call.v_head_dim)}
            for which in "qkv":
                source = f"{which} as passed to the attention function by {type(attn).__name__}"
                if which in "qk":
                    source += " (after rotary embedding and any q/k norm, as the scores use it)"
                stack = q_stack if which == "q" else kv_stack
                self._add(f"{name}.{which}", attn, which, shapes[which], stack, source + suffix)
            for which, names, count in (("q", _Q_NAMES, call.heads), ("k", _K_NAMES, call.kv_heads)):
                proj = next((getattr(attn, n) for n in names if hasattr(getattr(attn, n, None), "out_features")), None)
                if proj is not None and proj.out_features == count * call.head_dim:
                    self._add(f"{name}.{which}_pre", proj, "output", ("B", shapes[which][1], count, call.head_dim),
                              q_stack if which == "q" else kv_stack, f"output of {type(attn).__name__}'s {which} "
                              "projection: before rotary embedding and any q/k norm (TransformerLens hook_"
                              f"{which})", heads=count)
            self._add(f"{name}.pattern", attn, "pattern", ("B", "T", call.heads, "S" if seq_kv == "S" else "T"),
                      q_stack, "attention probabilities softmax(q.k^T * scaling + the model's mask/bias), computed "
                      "from the q/k passed to the attention function (equal to eager attention weights; read only)")
            heads, v_dim = call.heads, call.v_head_dim
        elif (fused := fused_layout(attn)) is not None:  # Bloom, Falcon, MPT, GPT-1: one q/k/v projection
            proj = getattr(attn, fused.projection)
            for which in "qkv":
                self._add(f"{name}.{which}", proj, "output", ("B", "T" if which == "q" else seq_kv, fused.heads[which],
                                                               fused.head_dim), q_stack if which == "q" else kv_stack,
                          describe(fused, which) + suffix, heads=fused.heads[which], part=fused.parts[which])
            heads, v_dim = fused.heads["q"], fused.head_dim
        else:
            attn = projection_owner(attn, _Q_NAMES)  # GPT-Neo, MPNet: the projections sit one module down
            layout = head_layout(attn, self.config)
            if layout is None:
                return
            heads, kv_heads, head_dim = layout
            for which, names in zip("qkv", (_Q_NAMES, _K_NAMES, _V_NAMES)):
                proj_name = next((n for n in names if hasattr(getattr(attn, n, None), "weight")), None)
                if proj_name is None:
                    continue
                count = heads if which == "q" else kv_heads
                note = families.NOTES.get(self.model_type, {}).get(which) or \
                    f"output of the {proj_name} projection (this attention does not use the attention-function " \
                    "interface, so no rotary embedding is applied here)"
                stack = q_stack if which == "q" else kv_stack
                view = projection_view(self._view, block, getattr(attn, proj_name), trace)
                if view is None:
                    continue
                self._add(f"{name}.{which}", getattr(attn, proj_name), "output",
                          ("B", "T" if which == "q" else seq_kv, count, head_dim), stack, note + suffix, heads=count,
                          view=view)
            v_dim = head_dim
        z = _get(block, z_path)
        if z is not None and in_width(z) == heads * v_dim:
            self._add(f"{name}.z", z, "input", ("B", "T", heads, v_dim), q_stack,
                      f"input of {z_path} ({type(z).__name__}): each head's attention output before the "
                      "output projection", heads=heads)
