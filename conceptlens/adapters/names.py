"""Site names: canonical names, negative indices, TransformerLens hook names, HF module paths.

    resolver.resolve("blocks.-1.resid_out")          # canonical, negative index
    resolver.resolve("blocks.5.hook_resid_post")     # TransformerLens -> blocks.5.resid_out
    resolver.resolve("model.layers.5")               # HF module path  -> blocks.5.resid_out

TransformerLens names: `blocks.{i}.hook_resid_pre` / `_post`, `hook_attn_out`, `hook_mlp_out`,
`attn.hook_q` / `hook_k` -> `attn.q_pre` / `k_pre` (pre-rotary; the projection-read `attn.q` / `k`
where there is no rotary), `attn.hook_rot_q` / `hook_rot_k` -> `attn.q` / `k`, `attn.hook_v`,
`attn.hook_z`, `attn.hook_pattern`, `mlp.hook_post`. TransformerLens's `ln2.hook_normalized` and
`ln_final.hook_normalized` are refused with the site to use: they hold the normalised input before
the norm's weight and bias, which no site here holds (`mlp.in` and `final` are after them).
HF module paths from the model or its base model name the site that is that module's output
(`model.layers.5.mlp` -> `blocks.5.mlp_out`); a path naming one part of a summed site, or a
shared layer run as several blocks, raises with the site to use. Unknown names raise `KeyError`
listing close valid names.
"""

from __future__ import annotations

import difflib
import re
from typing import Protocol

from torch import nn

from conceptlens.sites.hooked_views import CallOf, Plus
from conceptlens.sites.site import Site

_BLOCK_NAME = re.compile(r"^((?:encoder|decoder)\.)?blocks\.(-?\d+)\.(.+)$")

TRANSFORMER_LENS = {
    "hook_resid_pre": "resid_in", "hook_resid_post": "resid_out", "hook_attn_out": "attn_out",
    "hook_mlp_out": "mlp_out", "attn.hook_q": "attn.q_pre", "attn.hook_k": "attn.k_pre", "attn.hook_v": "attn.v",
    "attn.hook_rot_q": "attn.q", "attn.hook_rot_k": "attn.k", "attn.hook_z": "attn.z",
    "attn.hook_pattern": "attn.pattern", "mlp.hook_post": "mlp.post",
}
"""TransformerLens hook (after `blocks.{i}.`) -> conceptlens site (after `blocks.{i}.`)."""
_TL_GLOBAL = {"hook_embed_total": "embed"}
_TL_BEFORE_WEIGHT = {"ln2.hook_normalized": "mlp.in", "ln_final.hook_normalized": "final"}
"""TransformerLens hooks before a norm's weight and bias -> the site after them (named in the refusal)."""


class SiteTable(Protocol):
    """What the resolver reads of an `Adapter`: its sites, block counts, the model and why
    names it could not place have no site."""

    model: nn.Module
    model_type: str
    sites: dict[str, Site]
    n_blocks: dict[str, int]
    problems: dict[str, str]


class NameResolver:
    """Turns any accepted spelling of a site into its canonical name."""

    def __init__(self, adapter: SiteTable) -> None:
        self.adapter = adapter

    @property
    def sites(self) -> dict[str, Site]:
        return self.adapter.sites

    def resolve(self, name: str) -> Site:
        if not isinstance(name, str):
            raise TypeError(f"a site name must be a string, got {type(name).__name__}: {name!r}")
        canonical = self.canonical(name)
        if canonical in self.sites:
            return self.sites[canonical]
        raise KeyError(self._unknown(name, canonical))

    def translate(self, name: str) -> str:
        """What `name` maps to (a canonical site name), without checking it exists."""
        return self.canonical(name)

    def canonical(self, name: str) -> str:
        block = _BLOCK_NAME.match(name)
        hook = block.group(3) if block else name
        if hook in _TL_BEFORE_WEIGHT:
            after = _TL_BEFORE_WEIGHT[hook]
            site = after if hook == name else name[: -len(hook)] + after
            raise KeyError(f"no site {name!r}: TransformerLens's {hook} is the normalised input before the norm's "
                           f"weight and bias, which no site here holds; {site} is the norm's output, after them")
        name = _TL_GLOBAL.get(name, name)
        match = _BLOCK_NAME.match(name)
        if not match:
            return self._module_path(name) or name
        prefix, index, rest = match.group(1) or "", int(match.group(2)), match.group(3)
        rest = TRANSFORMER_LENS.get(rest, rest)
        n = self.adapter.n_blocks.get(prefix.rstrip("."))
        if n is not None and -n <= index < 0:
            index += n
        name = f"{prefix}blocks.{index}.{rest}"
        if rest.endswith(("q_pre", "k_pre")) and name not in self.sites:
            plain = name[: -len("_pre")]  # attention read from its projections: q/k are already pre-rotary
            if plain in self.sites and self.sites[plain].point == "output":
                return plain
        return name

    def _module_path(self, name: str) -> str | None:
        """An HF module path (from the model or its base model) -> the site that is its output."""
        module = self._module(name)
        if module is not None:
            outputs = [s.name for s in self.sites.values() if s.module is module and s.point == "output"
                       and s.find(Plus) is None]  # a summed site is not that module's output alone
            found = [n for n in outputs if ".resid_out" in n] or outputs  # an input site is not its output
            if any(self.sites[n].find(CallOf) is not None for n in found):
                return None  # one shared layer is several blocks: the module path names none of them
            if found:
                return found[0]
        return None

    def _module(self, name: str):
        model = self.adapter.model
        for root in (model, getattr(model, "base_model", model)):
            try:
                return root.get_submodule(name)
            except (AttributeError, ValueError):
                continue
        return None

    def _module_problem(self, name: str) -> str | None:
        """Why an HF module path names no site: one part of a summed site, or a shared layer."""
        module = self._module(name) if "." in name else None
        if module is None:
            return None
        for site in self.sites.values():
            plus = site.find(Plus)
            if site.point == "output" and plus is not None and (site.module is module or module in plus.others):
                return (f"no site {name!r}: its output is one part of {site.name}, which is the sum of "
                        f"{len(plus.others) + 1} modules' outputs; read or edit {site.name}")
        blocks = sorted({s.name.rsplit(".", 1)[0] for s in self.sites.values()
                         if s.module is module and s.find(CallOf) is not None and s.name.endswith(".resid_out")},
                        key=lambda b: int(b.rsplit(".", 1)[1]))
        if blocks:
            return (f"no site {name!r}: that module is one shared layer run as {len(blocks)} blocks "
                    f"({', '.join(blocks[:4])}{', ...' if len(blocks) > 4 else ''}); name the block, "
                    f"e.g. {blocks[0]}.resid_out")
        inputs = [s.name for s in self.sites.values() if s.module is module and s.point == "input"]
        if inputs:
            parent = self._module(name.rsplit(".", 1)[0])
            around = [s.name for s in self.sites.values() if s.module is parent and s.point == "output"
                      and s.find(Plus) is None] if parent is not None else []
            return (f"no site {name!r}: that module's output is no site here; its input is {inputs[0]}"
                    + (f", and its parent's output is {around[0]}" if around else ""))
        return None

    def _unknown(self, name: str, canonical: str) -> str:
        if canonical in self.adapter.problems:
            return f"no site {name!r}: {self.adapter.problems[canonical]}"
        if (problem := self._module_problem(name)) is not None:
            return problem
        match = _BLOCK_NAME.match(canonical)
        if match:
            prefix, index, rest = match.group(1) or "", int(match.group(2)), match.group(3)
            n = self.adapter.n_blocks.get(prefix.rstrip("."))
            if n is None:
                stacks = [f"{s}." for s in self.adapter.n_blocks if s] or ["no prefix"]
                return f"no site {name!r}; this model's stacks are {stacks}"
            if not -n <= index < n:
                return (f"no site {name!r}; the model has {prefix}blocks 0-{n - 1}, "
                        f"e.g. {prefix + 'blocks.' + str(n - 1) + '.' + rest!r}")
            if rest.split(".")[0] in ("attn", "cross_attn", "mlp") or rest.endswith("_out"):
                kinds = sorted({s.name.split(".", 2 + bool(prefix))[-1] for s in self.sites.values()
                                if s.name.startswith(f"{prefix}blocks.{index}.")})
                return (f"no site {name!r}: block {index} of {self.adapter.model_type} has no {rest} "
                        f"(its sites: {kinds})")
        close = difflib.get_close_matches(name, list(self.sites), n=5, cutoff=0.5)
        hint = f"; close valid names: {close}" if close else f"; valid names include {list(self.sites)[:8]}"
        return f"no site {name!r}{hint}"
