"""Generic fallback: find the block list and sublayers of an architecture with no entry.

Guesses by structure and naming: the longest ModuleList of identical blocks is the block
list; a norm registered after it is the final norm; inside a block, the first child whose
name mentions attention is the attention, and one named like an MLP is the MLP.
"""

from __future__ import annotations

import re

from torch import nn

from conceptlens.adapters.families import ArchSpec

_ATTN = re.compile(r"(^|_)(self_?attn|attn|attention|self_attention)$", re.I)
_MLP = re.compile(r"(^|_)(mlp|ffn|feed_?forward|ff)$", re.I)
_NORM = re.compile(r"norm|ln", re.I)


def find_blocks(root: nn.Module) -> str:
    """Path of the longest ModuleList whose children all share one class."""
    best, best_len = None, 0
    for name, module in root.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > best_len:
            if len({type(child) for child in module}) == 1:
                best, best_len = name, len(module)
    if best is None:
        raise ValueError(f"cannot find a list of transformer blocks in {type(root).__name__}: "
                         "no ModuleList of identical modules")
    return best


def _child_matching(block: nn.Module, pattern: re.Pattern) -> str | None:
    for name, _ in block.named_children():
        if pattern.search(name):
            return name
    return None


def _final_norm(root: nn.Module, blocks: str) -> str | None:
    parent_path = blocks.rpartition(".")[0]
    parent = root.get_submodule(parent_path) if parent_path else root
    names = [name for name, _ in parent.named_children()]
    after = names[names.index(blocks.rpartition(".")[2]) + 1:]
    for name in after:
        if _NORM.search(name) or "Norm" in type(getattr(parent, name)).__name__:
            return f"{parent_path}.{name}" if parent_path else name
    return None


def discover(base: nn.Module) -> ArchSpec:
    """An ArchSpec guessed from the module tree of `base` (a single-stack model)."""
    blocks = find_blocks(base)
    block = base.get_submodule(blocks)[0]
    attn = _child_matching(block, _ATTN)
    mlp = _child_matching(block, _MLP)
    if attn is None or mlp is None:
        children = [name for name, _ in block.named_children()]
        raise ValueError(f"cannot tell attention and MLP apart in {type(block).__name__} "
                         f"(children: {children}); add an ArchSpec for this model type")
    return ArchSpec({"": ""}, blocks, attn, attn, mlp, final=_final_norm(base, blocks),
                    notes={"all": "found by the generic fallback"})
