"""Recognise a model's stacks and block layouts by structure, not by `model_type`.

A *stack* is a module whose forward runs a list of blocks (the base model, its language
model, or an encoder / decoder). In each block the layout is read from module names and
classes — Llama/GPT-style (`self_attn`/`attn` + `mlp`), BERT-style post-LN (`attention.self`,
`attention.output`, `intermediate`, `output`), BART-style (`self_attn`, `encoder_attn`, `fc1`,
`fc2`), T5-style (`layer[i].SelfAttention` / `EncDecAttention` / `DenseReluDense`), MoE
blocks, state-space / hybrid blocks (a `mixer`) — and from one probe forward (`probe.py`):
which module calls the attention function, which norm reads the block input (pre-norm, so
the sublayer outputs add up to the block output) and which norm follows a sublayer (Gemma 2/3,
OLMo 2: the sublayer's contribution is that norm's output).
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


def recognise(block: nn.Module) -> BlockLayout | None:
    """The layout of a block from its module names and classes (None: not recognised)."""
    from conceptlens.adapters.direct import beside_layout  # it builds on this module's BlockLayout
    return _t5_layout(block) or _bert_layout(block) or beside_layout(block) or _generic_layout(block)


def children_summary(block: nn.Module) -> str:
    return ", ".join(f"{n} ({type(m).__name__})" for n, m in block.named_children())


def find_stacks(model: nn.Module) -> dict[str, str]:
    """Stack prefix -> path from the base model ("" is the base model itself)."""
    base = getattr(model, "base_model", model)
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        for enc_path, dec_path in (("encoder", "decoder"), ("text_encoder", "text_decoder")):  # SeamlessM4T
            enc, dec = _get(base, enc_path), _get(base, dec_path)
            if enc is not None and dec is not None:
                return {"encoder": enc_path, "decoder": dec_path}
    for path in ("language_model", "model.language_model", "text_model", "decoder", "transformer"):
        stack = _get(base, path)
        if stack is not None and find_block_list(stack) is not None and not _has_blocks_outside(base, stack):
            return {"": path}
    return {"": ""}


def _has_blocks_outside(base: nn.Module, stack: nn.Module) -> bool:
    # A stack is only worth splitting off when the base model runs more than it (e.g. a vision tower).
    return False


def expected_layers(config, prefix: str) -> int | None:
    text = config.get_text_config(decoder=prefix != "encoder") if hasattr(config, "get_text_config") else config
    keys = {"encoder": ("encoder_layers", "num_layers", "num_hidden_layers"),
            "decoder": ("decoder_layers", "num_decoder_layers", "num_layers", "num_hidden_layers")}.get(
        prefix, ("num_hidden_layers", "n_layer", "num_layers", "n_layers"))
    for source in (text, config):
        for key in keys:
            value = getattr(source, key, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def find_block_list(stack: nn.Module, expected: int | None = None) -> str | None:
    """Path of the stack's block list: the shallowest ModuleList not inside another one,
    preferring one whose length is the configured number of layers."""
    lists = [(name, m) for name, m in stack.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    top = [(n, m) for n, m in lists if not any(n.startswith(o + ".") for o, _ in lists if o != n)]
    top = [(n, m) for n, m in top if not is_norm(n.rpartition(".")[2], m[0]) and
           not isinstance(m[0], (nn.Embedding, nn.Linear))]
    if not top:
        return None
    exact = [(n, m) for n, m in top if expected is not None and len(m) == expected]
    pool = exact or top
    return min(pool, key=lambda item: (item[0].count("."), -len(item[1])))[0]


def final_norm_candidates(stack: nn.Module, blocks_path: str) -> list[str]:
    """Norms that are children of the block list's parent or of any module above it in the stack."""
    return [path for path, name, module in _children_above(stack, blocks_path) if is_norm(name, module)]


def _children_above(stack: nn.Module, blocks_path: str):
    """(path, name, module) of the children of the block list's parent and of every module above
    it in the stack, innermost first."""
    parts = blocks_path.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        parent_path = ".".join(parts[:depth])
        parent = stack.get_submodule(parent_path) if parent_path else stack
        for name, module in parent.named_children():
            yield (f"{parent_path}.{name}" if parent_path else name), name, module


class ParallelBlock(nn.Module):
    """Layer i of a stack that keeps each sublayer in its own ModuleList (XLM, FlauBERT): a
    container of the real modules `lists[name][i]`, never called and never attached to the model;
    its sites hook those modules (its input is the first's, its output the last's)."""

    def __init__(self, parts: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, module in parts.items():
            self.add_module(name, module)


def parallel_blocks(stack: nn.Module, path: str) -> list[tuple[nn.Module, nn.Module, nn.Module]] | None:
    """(block, first module, last module) per layer when the stack keeps attention, norms and
    FFN in sibling ModuleLists of one length, in the order they are registered (the probe then
    checks the blocks against the hidden states); None when it does not look like that."""
    parent_path = path.rpartition(".")[0]
    parent = stack.get_submodule(parent_path) if parent_path else stack
    n = len(stack.get_submodule(path))
    lists = {name: m for name, m in parent.named_children() if isinstance(m, nn.ModuleList) and len(m) == n}
    kinds = [_kind(name, m[0]) for name, m in lists.items()]
    if "attn" not in kinds or "mlp" not in kinds:
        return None
    names = list(lists)
    first = next(name for name, kind in zip(names, kinds) if kind == "attn")
    return [(ParallelBlock({name: lists[name][i] for name in names}), lists[first][i], lists[names[-1]][i])
            for i in range(n)]


def after_candidates(stack: nn.Module, blocks_path: str) -> list[str]:
    """Other modules beside the block list (or above it) that may run after the last block: a
    hyper-connection head, a stream mixer (not norms, lists, embeddings or rotary tables)."""
    return [path for path, name, module in _children_above(stack, blocks_path)
            if not (is_norm(name, module) or isinstance(module, (nn.ModuleList, nn.Embedding))
                    or re.search(r"embed|rotary|rope|pos", name, re.I) or not list(module.parameters()))]
