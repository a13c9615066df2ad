"""Recognise a model's stacks and block layouts by structure, not by `model_type`.

A *stack* is a module whose forward runs a list of blocks (the base model, its language
model, or an encoder / decoder). In each block the layout is read from module names and
classes — Llama/GPT-style (`self_attn`/`attn` + `mlp`), BERT-style post-LN (`attention.self`,
`attention.output`, `intermediate`, `output`), BART-style (`self_attn`, `encoder_attn`, `fc1`,
`fc2`), T5-style (`layer[i].SelfAttention` / `EncDecAttention` / `DenseReluDense`), MoE
blocks, state-space / hybrid blocks (a `mixer`) — and from one probe forward (`probe_pass.py`):
which module calls the attention function, which norm reads the block input (pre-norm, so
the sublayer outputs add up to the block output) and which norm follows a sublayer (Gemma 2/3,
OLMo 2: the sublayer's contribution is that norm's output).

Stacks and block lists are found by `stacks.py`: a stack is the base model, its
`language_model`, or `encoder` / `decoder` when `is_encoder_decoder`; its block list the
shallowest ModuleList not inside another, preferring one of the configured layer count. Per
block (hybrids differ per layer) one of: T5-style (`layer[i].SelfAttention | LocalSelfAttention
| TransientGlobalSelfAttention`, `EncDecAttention`, `DenseReluDense | mlp`), BERT-style
(`attention.self`, `attention.output.dense`, `intermediate`, `output.dense`, `crossattention`;
FNet's token mixer `fourier.self` is `mixer_out`, with no q/k/v), or child-based (attention /
cross-attention / MLP / mixer children by name, then by class: `*Attention`, `*MLP` / `*MoE` /
`*SparseMoeBlock`, `*Mamba*` / `*Mixer` / `*GatedDeltaNet` / `*ShortConv`; BART-style `fc1` /
`fc2` in the block). The probe then decides: the module that calls the attention function is the
q/k/v module; a norm whose input is the sublayer's output replaces it as the contribution; for a
post-LN block the contribution is the dense output before the add-and-norm; a block is additive
(pre-norm) when some norm inside it reads the block input exactly and finishes before the
sublayer outputs (MRA's attention returns exactly zero without its CUDA kernel, so its post-LN
norm read the block input exactly); a 2-D MLP output means flat `(B*T, d)` rows (OPT, Llama 4),
viewed back as `(B, T, d)` from the block's input.

A stack that keeps each sublayer in its own ModuleList (XLM, FlauBERT: `attentions`,
`layer_norm1`, `ffns`, `layer_norm2`) gets one `ParallelBlock` per index, a container of
`list[i]` for each sibling list of that length (never called, never attached to the model): its
`resid_in` is the attention module's input and its `resid_out` the output of the last registered
list's module; the probe checks both, so another order is refused (FlauBERT's `pre_norm`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

_ATTN_NAME = re.compile(r"^(self_?attn|attn|attention|self_attention|self_att|attn_layer|mha|multi_head_attention)$")
_CROSS_NAME = re.compile(r"(encoder_attn|cross_?attn|crossattention|cross_attention|EncDecAttention)", re.I)
_MLP_NAME = re.compile(r"^(mlp|ffn|feed_forward|feedforward|block_sparse_moe|moe|ff|mlp_block|ffn_layer|"
                       r"sparse_moe_block|DenseReluDense)$")
_MIXER_NAME = re.compile(r"^(mixer|linear_attn|mamba|ssm|conv|temporal_block|short_conv|token_mixer|recurrent|"
                         r"mamba_mixer|linear_attention|mlstm_layer|slstm_layer)$")
_ATTN_CLASS = re.compile(r"Attention|Attn")
_MLP_CLASS = re.compile(r"MLP|Mlp|FeedForward|FFN|Ffn|MoE|Moe|SparseBlock|Experts|DenseActDense|DenseGatedActDense")
_MIXER_CLASS = re.compile(r"Mamba|Mixer|DeltaNet|LinearAttention|ShortConv|Recurrent|RgLru|SSM|Ssm|Conv(?!ert)")
_NORM_CLASS = re.compile(r"Norm(\dd)?$|Norm(alization)?$")
_NORM_NAME = re.compile(r"(norm|^ln|_ln|ln_|layernorm)", re.I)
_OUT_PROJ = ("o_proj", "out_proj", "c_proj", "dense", "o", "out_lin", "wo", "output_proj", "proj", "out")
_DOWN_PROJ = ("down_proj", "fc2", "c_proj", "dense_4h_to_h", "wo", "w2", "lin2", "fc_out", "output_dense",
              "dense_output")


def is_norm(name: str, module: nn.Module) -> bool:
    return bool(_NORM_CLASS.search(type(module).__name__) or isinstance(module, (nn.LayerNorm, nn.GroupNorm))) \
        or (bool(_NORM_NAME.search(name)) and not list(module.children()))


@dataclass
class BlockLayout:
    """Which modules of one block give its sites (paths are relative to the block)."""

    style: str
    """Layout in words: "sequential pre-norm", "BERT-style post-LN", ..."""
    attn: str | None = None
    """Module that calls the attention function (q/k/v sites), or that owns the q/k/v projections."""
    attn_out: str | None = None
    cross_attn: str | None = None
    cross_attn_out: str | None = None
    mixer_out: str | None = None
    mlp_out: str | None = None
    branch_out: str | None = None
    """A further branch the block adds beside attention and MLP (Gemma 4's per-layer input)."""
    mlp_post: str | None = None
    """Module whose *input* is the MLP's hidden activation (the down projection)."""
    attn_z: str | None = None
    """Module whose *input* is the per-head attention output (the output projection)."""
    additive: bool = True
    """resid_out == resid_in + attn_out (+ cross_attn_out) (+ mixer_out) + mlp_out."""
    flat_mlp: bool = False
    notes: dict[str, str] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    """Kind -> why that site is left out (a post-LN sublayer that norms inside itself, unreadable)."""
    parts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Kind -> further sublayers of that kind whose outputs its site adds (LongCat-Flash's pairs)."""
    replaced: dict[str, str] = field(default_factory=dict)
    """Kind -> the sublayer path a post-sublayer norm replaced (tried again if the sum fails)."""
    other_stream: tuple[str, ...] = ()
    """Kinds that add to a reversible block's other residual stream, not to resid_in -> resid_out
    (`streams.py`): resid_out = resid_in + the other kinds."""
    inner_calls: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Kind -> (call, sublayer path): the site is that call of its module in each forward of the
    sublayer (a module called several times inside it, `inner.py`)."""
    resid_coef: float = 1.0
    """The block's constant coefficient on resid_in: resid_out == resid_coef * resid_in + the sublayer sites."""
    resid_in: str | None = None
    """Module whose *output* is resid_in (a block that normalises its input before its residual), or None."""
    adds: list = field(default_factory=list)
    """`residual.ResidualAdd`s, where the block is a chain of scaled residual adds instead (not additive)."""


def mlp_container(lay: BlockLayout) -> str | None:
    """Path of the module that holds the MLP's down projection, so that its input is what the
    MLP reads: the mlp_out sublayer, or the one a post-sublayer norm replaced; else None."""
    if lay.flat_mlp or not lay.mlp_post or "mlp_out" in lay.dropped or "mlp_out" in lay.inner_calls:
        return None
    for path in (lay.mlp_out, lay.replaced.get("mlp_out")):
        if path and lay.mlp_post.startswith(path + "."):
            return path
    return None


def _get(root: nn.Module, path: str | None) -> nn.Module | None:
    if path is None:
        return None
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def _child(module: nn.Module, names: tuple[str, ...]) -> str | None:
    children = dict(module.named_children())
    return next((n for n in names if isinstance(children.get(n), nn.Linear) or
                 type(children.get(n)).__name__.endswith("Linear") or
                 (children.get(n) is not None and hasattr(children[n], "weight"))), None)


def _join(*parts: str | None) -> str | None:
    return None if any(p is None for p in parts) else ".".join(p for p in parts if p)


def _kind(name: str, module: nn.Module) -> str | None:
    cls = type(module).__name__
    if is_norm(name, module):
        return None
    if _CROSS_NAME.search(name) or (_ATTN_CLASS.search(cls) and _CROSS_NAME.search(cls)):
        return "cross"
    for kind, pattern in (("attn", _ATTN_NAME), ("mlp", _MLP_NAME), ("mixer", _MIXER_NAME)):
        if pattern.match(name):
            return kind
    if _MIXER_CLASS.search(cls):
        return "mixer"
    if _ATTN_CLASS.search(cls):
        return "attn"
    if _MLP_CLASS.search(cls):
        return "mlp"
    return None


def _t5_layout(block: nn.Module) -> BlockLayout | None:
    parts = getattr(block, "layer", None)
    if not isinstance(parts, nn.ModuleList):
        return None
    lay = BlockLayout("T5-style (layer[i].SelfAttention / EncDecAttention / feed-forward)")
    for i, part in enumerate(parts):
        names = dict(part.named_children())
        for attr in ("SelfAttention", "LocalSelfAttention", "TransientGlobalSelfAttention", "EncDecAttention"):
            if attr in names:
                path = f"layer.{i}.{attr}"
                if attr != "EncDecAttention":
                    lay.attn = lay.attn_out = path
                else:
                    lay.cross_attn = lay.cross_attn_out = path
                lay.attn_z = lay.attn_z if attr == "EncDecAttention" else _join(path, _child(names[attr], _OUT_PROJ))
        for attr in ("DenseReluDense", "mlp"):
            if attr in names:
                lay.mlp_out = f"layer.{i}.{attr}"
                lay.mlp_post = _join(lay.mlp_out, _child(names[attr], _DOWN_PROJ))
    return lay if lay.attn and lay.mlp_out else None


def _bert_layout(block: nn.Module) -> BlockLayout | None:
    children = dict(block.named_children())
    attention, output = children.get("attention"), children.get("output")
    if output is None or "intermediate" not in children or not hasattr(output, "dense"):
        return None
    if attention is None:  # FNet: a token mixer in the attention's place (`fourier.self` / `fourier.output`)
        mixer = next((n for n, m in children.items() if n not in ("intermediate", "output") and
                      isinstance(getattr(m, "self", None), nn.Module) and hasattr(m, "output")), None)
        if mixer is None:
            return None
        return BlockLayout(f"BERT-style with a token mixer ({mixer}.self / {mixer}.output / intermediate / output)",
                           mixer_out=f"{mixer}.self", mlp_out="output.dense", mlp_post="output.dense")
    att_out = getattr(attention, "output", None)
    if att_out is None or not hasattr(att_out, "dense") or not hasattr(output, "dense"):
        return None
    lay = BlockLayout("BERT-style (attention.self / attention.output / intermediate / output)",
                      attn="attention.self" if hasattr(attention, "self") else "attention",
                      attn_out="attention.output.dense", mlp_out="output.dense", mlp_post="output.dense",
                      attn_z="attention.output.dense")
    cross = children.get("crossattention")
    if cross is not None and hasattr(getattr(cross, "output", None), "dense"):
        lay.cross_attn, lay.cross_attn_out = "crossattention.self", "crossattention.output.dense"
    return lay


def _generic_layout(block: nn.Module) -> BlockLayout | None:
    lay = BlockLayout("sequential")
    names = dict(block.named_children())
    for name, module in block.named_children():
        kind = _kind(name, module)
        if kind == "attn" and lay.attn is None:
            lay.attn = lay.attn_out = name
            lay.attn_z = _join(name, _child(module, _OUT_PROJ))
        elif kind == "cross" and lay.cross_attn is None:
            lay.cross_attn = lay.cross_attn_out = name
        elif kind == "mlp" and lay.mlp_out is None:
            lay.mlp_out = name
            lay.mlp_post = _join(name, _child(module, _DOWN_PROJ))
        elif kind == "mixer" and lay.mixer_out is None:
            lay.mixer_out = name
    if lay.mlp_out is None and "fc1" in names and "fc2" in names:  # BART-style: fc1 / fc2 in the block
        lay.mlp_out = lay.mlp_post = "fc2"
        lay.style = "BART-style (self_attn / encoder_attn / fc1 / fc2)"
    if lay.attn is None and lay.mixer_out is None and lay.mlp_out is None:
        return None
    if lay.attn is None and lay.mixer_out is None:  # attention nested deeper (DBRX): found by the probe's caller
        lay.style = "sequential (attention inside a wrapper)"
    elif lay.mixer_out is not None and lay.attn is None:
        lay.style = "state-space / mixer block"
    return lay


_BESIDE = ("post_attention", "attention_output", "attn_output")
_PROJ = ("dense", "conv1d")


def _projection(module: nn.Module | None) -> str | None:
    return next((n for n in _PROJ if hasattr(getattr(module, n, None), "weight")), None)


def beside_layout(block: nn.Module) -> BlockLayout | None:
    """attention + its output block as a sibling (`post_attention`) + intermediate + output."""
    children = dict(block.named_children())
    beside = next((n for n in _BESIDE if n in children), None)
    if "attention" not in children or beside is None or "intermediate" not in children:
        return None
    a, o = _projection(children[beside]), _projection(children.get("output"))
    if a is None or o is None:
        return None
    return BlockLayout(f"BERT-style with the attention's output beside it (attention / {beside} / intermediate / "
                       "output)", attn="attention", attn_out=f"{beside}.{a}", mlp_out=f"output.{o}",
                       mlp_post=f"output.{o}", attn_z=f"{beside}.{a}")


def recognise(block: nn.Module) -> BlockLayout | None:
    """The layout of a block from its module names and classes (None: not recognised)."""
    return _t5_layout(block) or _bert_layout(block) or beside_layout(block) or _generic_layout(block)


def children_summary(block: nn.Module) -> str:
    return ", ".join(f"{n} ({type(m).__name__})" for n, m in block.named_children())
