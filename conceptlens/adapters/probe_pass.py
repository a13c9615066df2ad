"""One probe forward at attach: what each module of each block read and returned.

The probe runs the model once on a few tokens (5; 3 for a decoder) with
`output_hidden_states=True` and `use_cache=False` (eval mode, restored after) and records, for
every module inside the blocks, its first input and first output tensor, how often it ran and in
which order it finished, and which modules called the attention function (with their query / key
lengths: cross-attention's differ). The adapter uses it to finish the block layouts and to check
them against HF's hidden states. It stops once the last stack has returned (an offloaded LM head
never runs) and removes the output-capturing hooks transformers installs on a first
`output_hidden_states` forward, so attaching leaves the model's hooks as they were.

`sums_to` checks a sum in float32 and also in the model's dtype, adding the terms in each order:
that reproduces a bf16 / fp16 block's own adds bit for bit, where a float32 sum of the rounded
outputs is a rounding step (~4e-3 relative) off, so the 1e-4 tolerance is never loosened. Cast
to bfloat16 after attaching in float32, 236 of 245 coverage types keep exactly the same sites
(float16: 236); transformers itself fails in low precision on CPU for FNet, MRA and Inkling 2;
Zaya is refused in bf16; Beam, Dory, ESM-C, MiniCPM3, MiniMax (constants that are not short
decimals, or per-channel rates), LongCat-Flash (summed sublayers) and RWKV (block 0) lose the
sublayer sites they cannot read exactly, with the reason. The real SmolLM2 in bf16 keeps all 362.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from conceptlens.hooks.attention import observe_calls
from conceptlens.hooks.handles import HandleGroup

if TYPE_CHECKING:
    from conceptlens.hooks.manager import HookManager

ENCODER_TOKENS, DECODER_TOKENS = 5, 3


@dataclass(frozen=True)
class Call:
    module: nn.Module
    q_len: int
    k_len: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    key: Tensor | None = field(default=None, compare=False, repr=False)
    value: Tensor | None = field(default=None, compare=False, repr=False)
    """The keys / values of a call with more keys than queries (kept to tell which are the tokens')."""
    shared_kv: bool = False
    """The call passed one tensor as both keys and values (DeepSeek-V4)."""


@dataclass
class Trace:
    inputs: dict[nn.Module, Tensor] = field(default_factory=dict)
    outputs: dict[nn.Module, Tensor] = field(default_factory=dict)
    calls: dict[nn.Module, int] = field(default_factory=dict)
    attention: list[Call] = field(default_factory=list)
    """Each attention-function call, in order."""
    hidden: dict[str, tuple[Tensor, ...]] = field(default_factory=dict)
    """Stack prefix -> HF's hidden states."""
    lengths: dict[str, int] = field(default_factory=dict)
    """Stack prefix -> length of the stack's token input in the probe."""
    sequence: list[nn.Module] = field(default_factory=list)
    """Block modules in the order their calls finished (a shared layer appears once per call)."""
    per_call: dict[tuple[nn.Module, int], tuple[Tensor | None, Tensor | None]] = field(default_factory=dict)
    """(block module, k) -> (input, output) of its k-th call."""
    parts: dict[nn.Module, tuple[Tensor | None, ...]] = field(default_factory=dict)
    """Module returning a tuple of several tensors -> each of them (first call; None: not a tensor)."""
    args: dict[nn.Module, tuple[Tensor | None, ...]] = field(default_factory=dict)
    """Module called with several positional tensors -> each of them (first call)."""
    streams: dict[nn.Module, tuple[dict[str, Tensor], list[Tensor | None]]] = field(default_factory=dict)
    """Block module -> (every tensor argument by name, every element of its output) of its first call."""
    later: dict[tuple[nn.Module, int], tuple[Tensor | None, Tensor | None]] = field(default_factory=dict)
    """(module inside a block, k >= 1) -> (input, output) of its k-th call (`inputs` / `outputs` hold the first)."""

    def io(self, block: nn.Module, call: int | None) -> tuple[Tensor | None, Tensor | None]:
        """(input, output) of a block's `call`-th call (None: its first, as `inputs` / `outputs`)."""
        if not call:
            return self.inputs.get(block), self.outputs.get(block)
        return self.per_call.get((block, call), (None, None))


def first_tensor(x) -> Tensor | None:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, (tuple, list)) and x:
        return first_tensor(x[0])
    if hasattr(x, "last_hidden_state"):
        return x.last_hidden_state
    if isinstance(x, dict) and x:
        return first_tensor(next(iter(x.values())))
    return None


def _record(trace: Trace):
    def hook(module, args, kwargs, output):
        trace.calls[module] = trace.calls.get(module, 0) + 1
        x = first_tensor(args) if args else first_tensor(kwargs.get("hidden_states"))
        y = first_tensor(output)
        if module in trace.outputs:
            trace.later[(module, trace.calls[module] - 1)] = (None if x is None else x.detach().clone(),
                                                              None if y is None else y.detach().clone())
            return
        if x is not None:
            trace.inputs[module] = x.detach().clone()
        if y is not None:
            trace.outputs[module] = y.detach().clone()
        for record, values in ((trace.parts, output), (trace.args, args)):
            if isinstance(values, (tuple, list)) and sum(isinstance(v, Tensor) for v in values) > 1:
                record[module] = tuple(v.detach().clone() if isinstance(v, Tensor) else None for v in values)

    return hook


def _tensors(args, kwargs, output) -> tuple[dict[str, Tensor], list[Tensor | None]]:
    named = {**{f"args[{i}]": a for i, a in enumerate(args)}, **kwargs}
    ins = {n: t.detach().clone() for n, t in named.items() if isinstance(t, Tensor)}
    outs = list(output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else [output])
    return ins, [t.detach().clone() if isinstance(t, Tensor) else None for t in outs]


def _record_calls(trace: Trace):
    def hook(module, args, kwargs, output):
        k = sum(1 for m in trace.sequence if m is module)
        trace.sequence.append(module)
        x = first_tensor(args) if args else first_tensor(kwargs.get("hidden_states"))
        y = first_tensor(output)
        if k == 0:
            trace.streams[module] = _tensors(args, kwargs, output)
        trace.per_call[(module, k)] = (None if x is None else x.detach().clone(),
                                       None if y is None else y.detach().clone())

    return hook


def _implementations(model: nn.Module) -> set[str]:
    names = {"eager"}
    for module in model.modules():
        config = getattr(module, "config", None)
        name = getattr(config, "_attn_implementation", None)
        if isinstance(name, str):
            names.add(name)
    return names


def probe_inputs(model: nn.Module) -> dict[str, Tensor]:
    get_embeddings = getattr(model, "get_input_embeddings", None)  # a transformers model's
    embeddings = get_embeddings() if callable(get_embeddings) else None
    weight = getattr(embeddings, "weight", None)
    device = weight.device if isinstance(weight, Tensor) and weight.device.type != "meta" else \
        next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    vocab = int(weight.shape[0]) if isinstance(weight, Tensor) else int(getattr(model.config, "vocab_size", 100))
    ids = (torch.arange(ENCODER_TOKENS) * 7 + 5) % max(vocab - 5, 1) + 4
    inputs = {"input_ids": ids[None].to(device)}
    if getattr(model.config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids[None, :DECODER_TOKENS].flip(-1).to(device)
    return inputs


class _StopProbe(Exception):
    """Raised after the last stack has returned its hidden states (the LM head is not needed)."""


def input_length(args, kwargs) -> int | None:
    """Length of a stack call's token input (input_ids, inputs_embeds or its first argument)."""
    x = kwargs.get("input_ids")
    x = x if x is not None else kwargs.get("inputs_embeds")
    x = x if x is not None or not args else args[0]
    return int(x.shape[1]) if isinstance(x, Tensor) and x.ndim >= 2 else None


def _stack_hook(trace: Trace, prefix: str, last: bool):
    def hook(module, args, kwargs, output):
        if (length := input_length(args, kwargs)) is not None:
            trace.lengths[prefix] = length
        hidden = getattr(output, "hidden_states", None)
        if hidden is not None:
            trace.hidden[prefix] = tuple(hidden)
            if last:
                raise _StopProbe

    return hook


def run_probe(hooks: HookManager, blocks: dict[str, list[nn.Module]], extra: Sequence[nn.Module] = (),
              stacks: dict[str, nn.Module] | None = None) -> Trace:
    """Run the probe forward on `hooks.model` with every module inside the blocks (and `extra`)
    recorded; it stops once the last stack has returned (so an offloaded LM head is never touched)."""
    model = hooks.model
    trace = Trace()
    handles = HandleGroup()
    out = None

    def on_call(module, query, key, value, kwargs) -> None:
        if query.ndim == 4 and key.ndim == 4:
            more = key.shape[2] != query.shape[2]
            trace.attention.append(Call(module, int(query.shape[2]), int(key.shape[2]), int(query.shape[1]),
                                        int(key.shape[1]), int(query.shape[3]), int(value.shape[-1]),
                                        key.detach().clone() if more else None, value.detach().clone() if more else None,
                                        key is value))

    training = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        handles.add(observe_calls(hooks, _implementations(model), on_call))
        for stack_blocks in blocks.values():
            for block in dict.fromkeys(stack_blocks):
                handles.add(hooks.forward_hook(block, _record_calls(trace), with_kwargs=True))
                for module in block.modules():
                    handles.add(hooks.forward_hook(module, _record(trace), with_kwargs=True))
        for module in extra:
            handles.add(hooks.forward_hook(module, _record(trace), with_kwargs=True))
            handles.add(hooks.forward_hook(module, _record_calls(trace), with_kwargs=True))
        stacks = stacks or {}
        for i, (prefix, stack) in enumerate(stacks.items()):
            hook = _stack_hook(trace, prefix, i == len(stacks) - 1)
            handles.add(hooks.forward_hook(stack, hook, with_kwargs=True))
        inputs = probe_inputs(model)
        with torch.no_grad(), hooks.dropping_new_hooks():  # transformers' output-capturing hooks
            out = model(**inputs, output_hidden_states=True, use_cache=False)
    except _StopProbe:
        pass
    finally:
        handles.remove()
        for module, mode in training:
            module.training = mode
    for prefix in blocks:
        if prefix in trace.hidden or out is None:
            continue
        name = {"encoder": "encoder_hidden_states", "decoder": "decoder_hidden_states"}.get(prefix, "hidden_states")
        hidden = getattr(out, name, None)
        if hidden is None and prefix == "":
            hidden = getattr(out, "decoder_hidden_states", None)
        if hidden is not None:
            trace.hidden[prefix] = tuple(h for h in hidden)
    return trace


def close(a: Tensor | None, b: Tensor | None, tol: float = 1e-5) -> bool:
    a, b = first_tensor(a), first_tensor(b)
    if a is None or b is None or a.shape != b.shape:
        return False
    a, b = a.float(), b.float().to(a.device)
    return bool(((a - b).abs().max() <= tol * (1 + b.abs().max())).item())


def sums_to(x: Tensor, outs: list[Tensor], y: Tensor, tol: float = 1e-4) -> bool:
    """x + sum(outs) == y at `tol` (relative to y's largest entry), formed in float32; where y is
    bfloat16 / float16 (a low-precision model), the sum is also formed in y's dtype, adding the
    terms in each order, as the block's own adds round it: float32 sums of rounded terms are off
    by a rounding step, far more than `tol`, while the block's own order reproduces y."""
    if close(x.float() + sum(o.float() for o in outs), y, tol):
        return True
    if y.dtype not in (torch.bfloat16, torch.float16) or len(outs) > 3:
        return False
    terms = [t.to(y.dtype) for t in (x, *outs)]
    for order in itertools.permutations(terms):
        total = order[0]
        for t in order[1:]:
            total = total + t
        if close(total, y, tol):
            return True
    return False
