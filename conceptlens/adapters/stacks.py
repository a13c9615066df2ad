"""Find a model's stacks, their block lists, final norms and the modules after the blocks.

A *stack* is a module whose forward runs a list of blocks (the base model, its language
model, or an encoder / decoder); `structure.py` recognises the layout inside each block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from conceptlens.adapters.structure import _get, _kind, is_norm

if TYPE_CHECKING:
    from conceptlens.adapters.probe_pass import Trace


@dataclass(frozen=True)
class StackPaths:
    stacks: dict[str, str]
    """Stack prefix ("" for single-stack models) -> path of the stack from the base model."""


def get_path(root: nn.Module, path: str) -> nn.Module:
    """`root.get_submodule(path)`, also accepting negative indices into ModuleLists."""
    module = root
    for part in path.split(".") if path else []:
        if part.lstrip("-").isdigit() and isinstance(module, (nn.ModuleList, nn.Sequential)):
            module = module[int(part)]
        else:
            module = getattr(module, part)
    return module


def block_list(stack: nn.Module, path: str) -> list[nn.Module]:
    """The blocks of the ModuleList at `path` (`find_block_list`'s)."""
    found = get_path(stack, path)
    if not isinstance(found, nn.ModuleList):
        raise ValueError(f"the block list {path!r} of {type(stack).__name__} is a {type(found).__name__}, "
                        "not a ModuleList")
    return list(found)


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


def hidden_size(config) -> int:
    """The residual's width as the (text) config states it."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "hidden_size", None) or getattr(text, "d_model"))


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


def norms_beside(stack: nn.Module, blocks: list[nn.Module], norms: list[nn.Module]) -> list[nn.Module]:
    """`norms` and the final-norm candidates beside every block list holding one of `blocks` (a
    looped stack keeps its layers in several lists: HRM)."""
    names = {m: n for n, m in stack.named_modules()}
    found = list(norms)
    for path in dict.fromkeys(names[b].rpartition(".")[0] for b in blocks if b in names):
        found += [m for c in final_norm_candidates(stack, path) if (m := get_path(stack, c)) not in found]
    return found


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
    blocks = stack.get_submodule(path)  # the ModuleList find_block_list found
    if not isinstance(blocks, nn.ModuleList):
        return None
    n = len(blocks)
    lists = {name: m for name, m in parent.named_children() if isinstance(m, nn.ModuleList) and len(m) == n}
    kinds = [_kind(name, m[0]) for name, m in lists.items()]
    if "attn" not in kinds or "mlp" not in kinds:
        return None
    names = list(lists)
    first = next(name for name, kind in zip(names, kinds) if kind == "attn")
    return [(ParallelBlock({name: lists[name][i] for name in names}), lists[first][i], lists[names[-1]][i])
            for i in range(n)]


def parallel_records(trace: Trace, io: dict[nn.Module, tuple[nn.Module, nn.Module]]) -> None:
    """Give each block made of parallel lists (`io`: block -> (first module, last module)) the
    probe's records of its first module (input, calls) and its last (output)."""
    for block, (first, last) in io.items():
        for record, module in ((trace.inputs, first), (trace.outputs, last)):
            if module in record:
                record[block] = record[module]
        trace.calls[block] = trace.calls.get(first, 0)


def after_candidates(stack: nn.Module, blocks_path: str) -> list[str]:
    """Other modules beside the block list (or above it) that may run after the last block: a
    hyper-connection head, a stream mixer (not norms, lists, embeddings or rotary tables)."""
    return [path for path, name, module in _children_above(stack, blocks_path)
            if not (is_norm(name, module) or isinstance(module, (nn.ModuleList, nn.Embedding))
                    or re.search(r"embed|rotary|rope|pos", name, re.I) or not list(module.parameters()))]
