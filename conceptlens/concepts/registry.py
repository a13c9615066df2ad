"""The one table of extractor methods: each method's name and what it declares about itself.

    method("topk").load()                 # TopKSAE
    method("topk").rows                   # "site": update(x) takes one site's rows (N, d)
    canonical("topk_sae")                 # "topk" (the name files written before 0.x used)
    names(rows="site")                    # the methods the CLI fits at one site

A method's name is the only one it has: the CLI's `--extractor NAME:...`, `ConceptSet.method`
in saved files, the class's `method`, the SAELens bridge and restore all use it. Names that
older files carry are its `aliases`; `canonical` maps them when a set or checkpoint is read.
Classes are named by import path and imported on demand, so this module imports nothing of
the package (a ConceptSet can read it without importing an extractor).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

Rows = Literal["site", "pair", "sites", "groups"]
"""What an extractor's `update` takes: "site" one site's rows `(N, d)`; "pair" the same tokens at a
(source, target) pair, `update(x_src, x_tgt)`; "sites" one tensor per site of a tuple (crosscoder);
"groups" ((inputs...), (outputs...)) as two tuples of tensors (cross-layer transcoder)."""
Concepts = Literal["decoder", "points", "differences"]
"""What its directions are: "decoder" an SAE's decoder rows (the set carries its encoder);
"points" centres or codes, each row assigned to the nearest (k-means, VQ, CLVQ); "differences"
differences of activations (Deleuzian)."""


@dataclass(frozen=True)
class Method:
    """One extractor method and its declared capabilities."""

    name: str
    """Its one name: CLI, files, `cls.method`."""
    target: str
    """"module:Class" of the extractor, imported by `load`."""
    rows: Rows = "site"
    """What `update` takes (see `Rows`)."""
    concepts: Concepts = "decoder"
    """What its directions are (see `Concepts`)."""
    sequence_ids: bool = False
    """`update` takes `sequence_ids=` (tokens grouped by document)."""
    tokens: bool = False
    """`update` takes `tokens=` (the token ids of its rows)."""
    saelens: str | None = None
    """The SAELens architecture a set of this method exports as, or None."""
    aliases: tuple[str, ...] = ()
    """Names older files used for it (read, never written)."""
    k_past_width: bool = False
    """Its `k` (pursuit steps) may exceed the number of concepts."""

    @property
    def reads(self) -> str:
        """What `update` takes, in words."""
        return {"site": "one site's rows", "pair": "a (source, target) pair of sites",
                "sites": "a tuple of sites", "groups": "((input sites...), (output sites...))"}[self.rows]

    def load(self) -> type:
        """The extractor class."""
        module, name = self.target.split(":")
        return getattr(importlib.import_module(module), name)


_SAE = "conceptlens.concepts.sae."
METHODS: MappingProxyType[str, Method] = MappingProxyType({m.name: m for m in (
    Method("kmeans", "conceptlens.concepts.kmeans:StreamingKMeans", concepts="points", tokens=True),
    Method("deleuzian", "conceptlens.concepts.deleuzian:Deleuzian", concepts="differences", tokens=True),
    Method("topk", _SAE + "topk:TopKSAE", saelens="topk", aliases=("topk_sae",)),
    Method("relu", _SAE + "relu:ReLUSAE", saelens="standard", aliases=("relu_sae",)),
    Method("jumprelu", _SAE + "jumprelu:JumpReLUSAE", saelens="jumprelu", aliases=("jumprelu_sae",)),
    Method("batchtopk", _SAE + "batchtopk:BatchTopKSAE", saelens="jumprelu", aliases=("batchtopk_sae",)),
    Method("spade", _SAE + "spade:SpaDE"),
    Method("matryoshka", _SAE + "matryoshka:MatryoshkaSAE", saelens="topk", aliases=("matryoshka_sae",)),
    Method("vq", "conceptlens.concepts.vq:VQCodebook", concepts="points"),
    Method("actmsae", _SAE + "nested:ActMSAE"),
    Method("ewg", _SAE + "nested:EWGSAE", aliases=("ewg_sae",)),
    Method("mpsae", _SAE + "mpsae:MPSAE", aliases=("mp_sae",), k_past_width=True),
    Method("hsae", _SAE + "hsae:HSAE", aliases=("h_sae",)),
    Method("clvq", "conceptlens.concepts.clvq:CLVQTranscoder", rows="pair", concepts="points", sequence_ids=True),
    Method("transcoder", _SAE + "transcoder:Transcoder", rows="pair", saelens="transcoder"),
    Method("skip_transcoder", _SAE + "transcoder:SkipTranscoder", rows="pair", saelens="skip_transcoder"),
    Method("crosscoder", _SAE + "crosscoder:Crosscoder", rows="sites"),
    Method("relu_crosscoder", _SAE + "crosscoder:ReLUCrosscoder", rows="sites"),
    Method("clt", _SAE + "clt:CrossLayerTranscoder", rows="groups", aliases=("cross_layer_transcoder",)),
)})
"""Every method the library has, by its one name (the CLI lists them in this order; a SAELens
architecture imports as the first method that exports to it)."""

_ALIASES = MappingProxyType({alias: m.name for m in METHODS.values() for alias in m.aliases})


def canonical(name: str) -> str:
    """The method's one name for `name` (an old alias maps to it; any other name is returned as is:
    sets built by hand carry their own, such as "probe")."""
    return _ALIASES.get(name, name)


def method(name: str) -> Method:
    """The method called `name` (or an old alias of it); a one-line ValueError naming the choices."""
    found = METHODS.get(canonical(name)) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"unknown extractor method {name!r}; choose one of {', '.join(METHODS)}")
    return found


def names(**capabilities: Any) -> tuple[str, ...]:
    """The methods whose declared capabilities equal the given ones, e.g. `names(rows="site")`."""
    return tuple(m.name for m in METHODS.values()
                 if all(getattr(m, key) == value for key, value in capabilities.items()))


def saelens_architectures(**capabilities: Any) -> dict[str, str]:
    """method -> the SAELens architecture it exports as, for the methods with one (and the given
    capabilities, as in `names`)."""
    return {name: arch for name in names(**capabilities) if (arch := METHODS[name].saelens) is not None}


def of(extractor: Any) -> Method | None:
    """The registered method of an extractor (object or class), or None for one of the user's own."""
    cls = extractor if isinstance(extractor, type) else type(extractor)
    found = METHODS.get(getattr(cls, "method", ""))
    return found if found is not None and found.load() is cls else None


def takes(extractor: Any, keyword: Literal["tokens", "sequence_ids"]) -> bool:
    """Whether `extractor.update` takes `keyword`: declared for a registered method, read from the
    signature of `update` for any other (a subclass such as `ShardedKMeans` too); for `tokens`, only
    when the instance's `wants_tokens` does not say no (a k-means or Deleuzian over tokens needs none)."""
    found = of(extractor)
    declared = bool(getattr(found, keyword)) if found is not None else (
        keyword in inspect.signature(extractor.update).parameters)
    return declared and (keyword != "tokens" or bool(getattr(extractor, "wants_tokens", True)))
