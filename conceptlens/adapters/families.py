"""Where each known architecture keeps its sites, as module paths.

Paths are relative to a *stack* (the base model for decoder-only and encoder-only models;
its `encoder` / `decoder` for encoder-decoders) or, for the per-block entries, relative to
one block. A numeric path part may be negative (`layer.-1.DenseReluDense`). An entry of
None means the family has no such module (post-LN encoders have no final norm).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class ArchSpec:
    """Module paths of one architecture family."""

    stacks: dict[str, str]
    """Stack prefix ("" for single-stack models) -> path of the stack from the base model."""
    blocks: str
    """Path of the block ModuleList inside a stack."""
    attn: str
    """Self-attention module inside a block (its q/k/v are the `attn.q/k/v` sites)."""
    attn_out: str
    """Module whose output is what attention adds to the residual stream."""
    mlp_out: str
    """Module whose output is what the MLP adds to the residual stream."""
    final: str | None = None
    """Final norm inside a stack; `final` is its output."""
    cross_attn: str | None = None
    """Cross-attention module inside a decoder block."""
    qkv: Literal["interface", "projections"] = "interface"
    """Read q/k/v from the attention function (post-rotary) or from the projections."""
    projections: tuple[str, str, str] = ("q_proj", "k_proj", "v_proj")
    """q/k/v projection names inside the attention module, for `qkv="projections"`."""
    flat_mlp: bool = False
    """The MLP sees `(B * T, d)` rows (OPT flattens the batch before fc1/fc2)."""
    notes: dict[str, str] = field(default_factory=dict)
    """Site kind -> remark shown by `lens.site(...)`."""


_LLAMA = ArchSpec({"": ""}, "layers", "self_attn", "self_attn", "mlp", final="norm")
_BERT = ArchSpec({"": ""}, "encoder.layer", "attention.self", "attention.output.dense", "output.dense",
                 notes={"attn_out": "post-LN: the attention output before the residual add and LayerNorm",
                        "mlp_out": "post-LN: the MLP output before the residual add and LayerNorm"})

FAMILIES: dict[str, ArchSpec] = {
    "gpt2": ArchSpec({"": ""}, "h", "attn", "attn", "mlp", final="ln_f"),
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "gemma2": ArchSpec({"": ""}, "layers", "self_attn", "post_attention_layernorm",
                       "post_feedforward_layernorm", final="norm",
                       notes={"attn_out": "after Gemma2's post-attention norm, as added to the residual",
                              "mlp_out": "after Gemma2's post-feedforward norm, as added to the residual"}),
    "gpt_neox": ArchSpec({"": ""}, "layers", "attention", "attention", "mlp", final="final_layer_norm",
                         notes={"attn_out": "parallel residual when use_parallel_residual"}),
    "opt": ArchSpec({"": "decoder"}, "layers", "self_attn", "self_attn", "fc2", final="final_layer_norm",
                   flat_mlp=True),
    "phi": ArchSpec({"": ""}, "layers", "self_attn", "self_attn", "mlp", final="final_layernorm",
                    notes={"attn_out": "parallel residual: attention and MLP both read resid_in"}),
    "bert": _BERT,
    "roberta": _BERT,
    "distilbert": ArchSpec({"": ""}, "transformer.layer", "attention", "attention", "ffn",
                           projections=("q_lin", "k_lin", "v_lin")),
    "deberta-v2": ArchSpec({"": ""}, "encoder.layer", "attention.self", "attention.output.dense", "output.dense",
                           qkv="projections", projections=("query_proj", "key_proj", "value_proj"),
                           notes={"q": "content query from query_proj (DeBERTa's attention does not go through "
                                       "the attention-function interface; its relative-position terms are separate)",
                                  "k": "content key from key_proj (see q)", "v": "from value_proj"}),
    "t5": ArchSpec({"encoder": "encoder", "decoder": "decoder"}, "block", "layer.0.SelfAttention",
                   "layer.0.SelfAttention", "layer.-1.DenseReluDense", final="final_layer_norm",
                   cross_attn="layer.1.EncDecAttention"),
    "bart": ArchSpec({"encoder": "encoder", "decoder": "decoder"}, "layers", "self_attn", "self_attn", "fc2",
                     final="layer_norm", cross_attn="encoder_attn"),
}
FAMILIES["deberta_v2"] = FAMILIES["deberta-v2"]
