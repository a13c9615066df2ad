"""Adapter: the table of sites of one model, built from its own modules.

    adapter = Adapter(model)
    adapter.sites["blocks.3.resid_out"]     # Site bound to model.model.layers[3]
    adapter.resolve("blocks.-1.attn.k")     # negative block indices work
"""

from __future__ import annotations

import difflib
import re
import sys

from torch import nn

from conceptlens.adapters.discover import discover
from conceptlens.adapters.families import FAMILIES, ArchSpec
from conceptlens.adapters.site import Site

_BLOCK_NAME = re.compile(r"^((?:encoder|decoder)\.)?blocks\.(-?\d+)\.(.+)$")
_Q_NAMES = ("q_proj", "query", "q", "query_proj", "q_lin")
_K_NAMES = ("k_proj", "key", "k", "key_proj", "k_lin")


def get_path(root: nn.Module, path: str) -> nn.Module:
    """`root.get_submodule(path)`, also accepting negative indices into ModuleLists."""
    module = root
    for part in path.split(".") if path else []:
        module = module[int(part)] if part.lstrip("-").isdigit() else getattr(module, part)
    return module


def _first_attr(obj: object, names: tuple[str, ...]) -> object | None:
    return next((getattr(obj, n) for n in names if getattr(obj, n, None) is not None), None)


def head_layout(attn: nn.Module, config) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of an attention module."""
    head_dim = _first_attr(attn, ("head_dim", "attention_head_size", "key_value_proj_dim", "d_kv"))
    heads = _first_attr(attn, ("num_heads", "num_attention_heads", "n_heads", "n_head"))
    q, k = _first_attr(attn, _Q_NAMES), _first_attr(attn, _K_NAMES)
    heads = heads or getattr(config, "num_attention_heads")
    head_dim = int(head_dim or (q.out_features // heads if q is not None else config.hidden_size // heads))
    if q is not None and hasattr(q, "out_features"):
        heads = q.out_features // head_dim
    kv_heads = k.out_features // head_dim if k is not None and hasattr(k, "out_features") else heads
    return int(heads), int(kv_heads), head_dim


def _uses_interface(attn: nn.Module) -> bool:
    # Modern attention modules call a function from ALL_ATTENTION_FUNCTIONS with post-rotary q/k.
    return hasattr(sys.modules.get(type(attn).__module__), "ALL_ATTENTION_FUNCTIONS")


class Adapter:
    """Every site of a model, found from its own modules (nothing is reimplemented)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = model.config
        self.family = getattr(self.config, "model_type", type(model).__name__)
        base = getattr(model, "base_model", model)
        self.spec: ArchSpec = FAMILIES.get(self.family) or discover(base)
        self.generic = self.family not in FAMILIES
        self.hidden_size = int(getattr(self.config, "hidden_size", None) or self.config.d_model)
        self.sites: dict[str, Site] = {}
        self.n_blocks: dict[str, int] = {}
        for prefix, stack_path in self.spec.stacks.items():
            self._add_stack(prefix, get_path(base, stack_path))

    def _add_stack(self, prefix: str, stack: nn.Module) -> None:
        spec, p = self.spec, f"{prefix}." if prefix else ""
        blocks = get_path(stack, spec.blocks)
        self.n_blocks[prefix] = len(blocks)
        resid = ("B", "T", self.hidden_size)
        for i, block in enumerate(blocks):
            b = f"{p}blocks.{i}"
            if i == 0:
                self._add(f"{p}embed", block, "input", resid, prefix, f"input to {type(block).__name__} 0")
            self._add(f"{b}.resid_in", block, "input", resid, prefix, f"input of {type(block).__name__} {i}")
            self._add(f"{b}.resid_out", block, "output", resid, prefix, f"output of {type(block).__name__} {i}")
            for kind in ("attn_out", "mlp_out"):
                path = getattr(spec, kind)
                module = get_path(block, path)
                note = spec.notes.get(kind, "")
                flat = block if kind == "mlp_out" and spec.flat_mlp else None
                self._add(f"{b}.{kind}", module, "output", resid, prefix,
                          f"output of {path} ({type(module).__name__})" + (f"; {note}" if note else ""),
                          flat_in=flat)
            self._add_qkv(f"{b}.attn", get_path(block, spec.attn), prefix, prefix)
            if spec.cross_attn and prefix == "decoder":
                self._add_qkv(f"{b}.cross_attn", get_path(block, spec.cross_attn), prefix, "encoder")
        if spec.final is not None:
            final = get_path(stack, spec.final) if _has_path(stack, spec.final) else None
            if final is not None:
                self._add(f"{p}final", final, "output", resid, prefix, f"output of the final norm ({spec.final})")

    def _add(self, name: str, module: nn.Module, point, shape, stack: str, source: str, heads=None,
             flat_in=None) -> None:
        self.sites[name] = Site(name, module, point, shape, stack, source, heads, flat_in)

    def _add_qkv(self, name: str, attn: nn.Module, q_stack: str, kv_stack: str) -> None:
        heads, kv_heads, head_dim = head_layout(attn, self.config)
        counts = {"q": heads, "k": kv_heads, "v": kv_heads}
        stacks = {"q": q_stack, "k": kv_stack, "v": kv_stack}
        seq = {"q": "T", "k": "T" if kv_stack == q_stack else "S", "v": "T" if kv_stack == q_stack else "S"}
        interface = self.spec.qkv == "interface" and _uses_interface(attn)
        for j, which in enumerate("qkv"):
            shape = ("B", seq[which], counts[which], head_dim)
            note = self.spec.notes.get(which, "")
            if interface:
                source = f"{which} as passed to the attention function by {type(attn).__name__}"
                if which in "qk":
                    source += " (after rotary embedding and any q/k norm, as the scores use it)"
                self._add(f"{name}.{which}", attn, which, shape, stacks[which], source)
                continue
            proj_name = self.spec.projections[j]
            proj = getattr(attn, proj_name, None)
            if proj is None:
                continue  # no q/k/v site: resolve() explains
            source = note or f"output of the {proj_name} projection (this attention does not use the attention-function interface)"
            self._add(f"{name}.{which}", proj, "output", shape, stacks[which], source, heads=counts[which])

    def resolve(self, name: str) -> Site:
        """The Site called `name`; negative block indices count from the end."""
        if not isinstance(name, str):
            raise TypeError(f"a site name must be a string, got {type(name).__name__}: {name!r}")
        canonical = self.canonical(name)
        if canonical in self.sites:
            return self.sites[canonical]
        raise KeyError(self._unknown(name))

    def canonical(self, name: str) -> str:
        match = _BLOCK_NAME.match(name)
        if not match:
            return name
        prefix, index, rest = match.group(1) or "", int(match.group(2)), match.group(3)
        n = self.n_blocks.get(prefix.rstrip("."))
        if n is not None and -n <= index < 0:
            index += n
        return f"{prefix}blocks.{index}.{rest}"

    def _unknown(self, name: str) -> str:
        match = _BLOCK_NAME.match(name)
        if match:
            prefix, index, rest = match.group(1) or "", int(match.group(2)), match.group(3)
            n = self.n_blocks.get(prefix.rstrip("."))
            if n is None:
                stacks = [f"{s}." for s in self.n_blocks if s] or ["no prefix"]
                return f"no site {name!r}; this model's stacks are {stacks}"
            if not -n <= index < n:
                return (f"no site {name!r}; the model has {prefix}blocks 0-{n - 1}, "
                        f"e.g. {prefix + 'blocks.' + str(n - 1) + '.' + rest!r}")
            if rest.split(".")[0] in ("attn", "cross_attn") and f"{prefix}blocks.0.{rest}" not in self.sites:
                return (f"no site {name!r}: {self.family} exposes no {rest} site "
                        f"(its attention has neither an attention-function call nor a projection for it)")
        close = difflib.get_close_matches(name, list(self.sites), n=5, cutoff=0.5)
        hint = f"; close valid names: {close}" if close else f"; valid names include {list(self.sites)[:8]}"
        return f"no site {name!r}{hint}"


def _has_path(root: nn.Module, path: str) -> bool:
    try:
        get_path(root, path)
    except (AttributeError, IndexError):
        return False
    return True
