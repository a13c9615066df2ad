"""Self-attention calls whose keys are this forward's tokens followed by others.

Two shapes are recognised from the probe (a forward without cache), each verified there:

- "stack": a decoder's attention attends its queries to [its own tokens' keys; the encoder's
  keys] in one call (T5Gemma2's merged attention). Verified: the call's values are exactly the
  module's value projection of its input followed by that of the encoder's output. Sites:
  `attn.q`, `attn.k` / `attn.v` (the decoder part), `cross_attn.k` / `cross_attn.v` (the
  encoder part), and the pattern split in the same two parts, as HF splits its weights.
- "appended": the keys are the tokens' followed by entries a submodule of the attention
  returns (DeepSeek V4's compressed KV entries). Verified: the trailing keys are exactly that
  submodule's output. `attn.k` / `attn.v` are the tokens' part; the pattern covers every key.

At run time (hooks/attention.py) the tokens' part is the first T keys without a cache, and with
one ("stack" only) the keys the self-attention cache returned. Such an attention is `attn_out`
once, never also `cross_attn_out`. A key and value passed as one tensor (DeepSeek-V4's K = V)
are edited out of place, so an edit of one leaves the other.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from conceptlens.adapters.probe_pass import ENCODER_TOKENS, Call, Trace, close, first_tensor
from conceptlens.adapters.structure import BlockLayout
from conceptlens.adapters.verify import call_of, submodule
from conceptlens.adapters.readings import with_split_keys

_V_NAMES = ("v_proj", "value", "v", "value_proj", "v_lin")


def key_layout(attn: nn.Module, call: Call | None, trace: Trace, stack: str) -> tuple[str, str] | None:
    """("stack" | "appended", what the extra keys are) for a self-attention call whose keys
    are the tokens' followed by others, verified on the probe; None otherwise."""
    if call is None:
        return None
    if stack == "decoder" and call.value is not None and call.k_len == call.q_len + ENCODER_TOKENS and \
            _values_are_own_then_encoder(attn, call, trace):
        return "stack", "the encoder's keys"
    child = _appending_child(attn, call, trace)
    if child is not None:
        return "appended", f"the entries {child[0]} ({type(child[1]).__name__}) returns (not a site)"
    return None


def _values_are_own_then_encoder(attn: nn.Module, call: Call, trace: Trace) -> bool:
    proj = next((getattr(attn, n) for n in _V_NAMES if isinstance(getattr(attn, n, None), nn.Linear)), None)
    own, encoder = trace.inputs.get(attn), (trace.hidden.get("encoder") or (None,))[-1]
    if proj is None or own is None or encoder is None or own.ndim != 3:
        return False
    with torch.no_grad():
        parts = [proj(x.to(proj.weight.device, proj.weight.dtype)) for x in (own, encoder)]
    parts = [p.view(*p.shape[:2], call.kv_heads, call.v_head_dim).transpose(1, 2) for p in parts
             if p.shape[-1] == call.kv_heads * call.v_head_dim]
    return len(parts) == 2 and close(torch.cat(parts, dim=2), call.value)


def _appending_child(attn: nn.Module, call: Call, trace: Trace) -> tuple[str, nn.Module] | None:
    """The direct child of `attn` whose output is exactly the keys after the tokens' (with
    (B, kv heads, n, head dim) layout; n may be 0 on the probe's few tokens)."""
    extra = call.k_len - call.q_len
    if extra < 0 or (extra and call.key is None):
        return None
    for name, child in attn.named_children():
        out = first_tensor(trace.outputs.get(child))
        if out is None or out.ndim != 4 or out.shape[1] != call.kv_heads or out.shape[3] != call.head_dim \
                or out.shape[2] != extra:
            continue
        if not extra or (call.key is not None and close(out, call.key[:, :, call.q_len:])):  # keys: checked above
            return name, child
    return None


def relayout(block: nn.Module, lay: BlockLayout, trace: Trace, stack: str) -> None:
    """A self-attention with more keys than queries is not cross-attention: its output is
    attn_out, once (the probe's key count made it look like cross-attention)."""
    attn = submodule(block, lay.cross_attn)
    layout = key_layout(attn, call_of(trace, attn), trace, stack) if attn is not None else None
    if layout is None or lay.cross_attn != lay.attn:
        return
    lay.cross_attn = None
    if lay.cross_attn_out is not None:
        if lay.attn_out is None:
            lay.attn_out = lay.cross_attn_out
            for found in (lay.notes, lay.replaced):
                if "cross_attn_out" in found:
                    found["attn_out"] = found["cross_attn_out"]
        if lay.cross_attn_out == lay.attn_out:
            lay.cross_attn_out = None
            lay.notes.pop("cross_attn_out", None)
            lay.replaced.pop("cross_attn_out", None)
    if layout[0] == "stack" and lay.attn_out is not None:
        note = f"self- and cross-attention in one call of {type(attn).__name__}"
        lay.notes["attn_out"] = f"{lay.notes['attn_out']}; {note}" if lay.notes.get("attn_out") else note


def add_split_attention(adapter, name: str, attn: nn.Module, call: Call, layout: tuple[str, str], stack: str,
                        suffix: str) -> tuple[int, int]:
    """The q/k/v/pattern sites of such a call (and cross_attn.k/v/pattern for "stack");
    returns (heads, value head dim) for the z site."""
    kind, extra = layout
    cls = type(attn).__name__
    where = f"the first T keys of {cls}'s call (which attends to them followed by {extra})"
    for which in "qkv":
        source = f"{which} as passed to the attention function by {cls}" + \
            (" (after rotary embedding and any q/k norm, as the scores use it)" if which in "qk" else "")
        if which != "q":
            source += f"; this forward's tokens: {where}"
        if which != "q" and call.shared_kv:
            source += "; the call passes one tensor as keys and values: an edit here changes only the " + \
                ("keys" if which == "k" else "values")
        heads = call.heads if which == "q" else call.kv_heads
        dim = call.v_head_dim if which == "v" else call.head_dim
        adapter._add(f"{name}.{which}", attn, which, ("B", "T", heads, dim), stack, source + suffix)
    proj = next((getattr(attn, n) for n in ("q_proj", "query", "q", "query_proj", "q_lin")
                 if hasattr(getattr(attn, n, None), "out_features")), None)
    if proj is not None and proj.out_features == call.heads * call.head_dim:
        adapter._add(f"{name}.q_pre", proj, "output", ("B", "T", call.heads, call.head_dim), stack,
                     f"output of {cls}'s q projection: before rotary embedding and any q/k norm "
                     "(TransformerLens hook_q)", heads=call.heads)
    softmax = "attention probabilities softmax(q.k^T * scaling + the model's mask/bias), computed from the q/k " \
              "passed to the attention function"
    if kind == "appended":
        adapter._add(f"{name}.pattern", attn, "pattern", ("B", "T", call.heads, "T+C"), stack,
                     f"{softmax} (equal to eager attention weights; read only), over every key: this forward's "
                     f"tokens, then {extra}" + suffix)
    else:
        cross = name.rpartition(".")[0] + ".cross_attn"
        for which in "kv":
            adapter._add(f"{cross}.{which}", attn, which, ("B", "S", call.kv_heads, call.v_head_dim if which == "v"
                                                           else call.head_dim), "encoder",
                         f"{which} as passed to the attention function by {cls}: the encoder's tokens, the keys "
                         "after the decoder's own in its merged self- and cross-attention call")
        merged = f"{softmax}, one softmax over [decoder keys; encoder keys] (equal to eager attention weights; " \
                 "read only): the columns of"
        adapter._add(f"{name}.pattern", attn, "pattern", ("B", "T", call.heads, "T"), stack,
                     f"{merged} the decoder's keys (rows sum to less than 1; cross_attn.pattern has the rest)" + suffix)
        adapter._add(f"{cross}.pattern", attn, "pattern", ("B", "T", call.heads, "S"), stack,
                     f"{merged} the encoder's keys (attn.pattern has the rest)")
    for site in [s for s in adapter.sites.values() if s.module is attn and s.point in ("q", "k", "v", "pattern")]:
        adapter.sites[site.name] = replace(site, views=with_split_keys(site.views, kind))
    return call.heads, call.v_head_dim
