"""Fit keys: which sites an extractor reads, how its entry is named, where its directions live;
`plan_extractors` resolves a fit's `{key: extractor}` into named extractors and their sites.

    key_name(("blocks.0.mlp.in", "blocks.0.mlp_out"))          # "blocks.0.mlp.in->blocks.0.mlp_out"
    key_sites((("blocks.0.mlp.in", "blocks.1.mlp.in"), ("blocks.0.mlp_out", "blocks.1.mlp_out")))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from conceptlens._names import RULE as NAME_RULE, is_name
from conceptlens.concepts import registry

if TYPE_CHECKING:
    from conceptlens.interface import AttachedModel

Key = str | tuple[str, ...] | tuple[tuple[str, ...], tuple[str, ...]]
"""A site; (source, target) for a transcoder; (site, site, ...) for a crosscoder; ((inputs...),
(outputs...)) for a cross-layer transcoder. The extractor's update gets one tensor per element,
a tuple of tensors for a group."""


def key_name(key: Key, extractor: Any = None) -> str:
    """The entry's default name: the site, "source->target", "a+b" (or "first..last" past two
    sites; two sites read by an `extractor` whose directions span them, a crosscoder's, are "a+b"
    too, not a source and target), "inputs->outputs" for groups."""
    if isinstance(key, str):
        return key
    if len(key) == 2 and _spans(extractor) and all(isinstance(k, str) for k in key):
        return "+".join(key_sites(key))
    if len(key) == 2:
        return f"{_group_name(key[0])}->{_group_name(key[1])}"
    return _group_name(key)


def _spans(extractor: Any) -> bool:
    """Whether an extractor's directions live at every site it reads (a crosscoder's)."""
    return getattr(extractor, "directions_at", "source") == "sites"


def _group_name(group: str | tuple[str, ...]) -> str:
    if isinstance(group, str):
        return group
    return "+".join(group) if len(group) <= 2 else f"{group[0]}..{group[-1]}"


def folder(name: str) -> str:
    """An extractor's name as a folder name ("->" and "+" spelled out)."""
    return name.replace("->", "__to__").replace("+", "__and__")


def key_sites(key: Key) -> tuple[str, ...]:
    """Every site a key reads, in order."""
    return (key,) if isinstance(key, str) else tuple(s for g in key for s in ((g,) if isinstance(g, str) else g))


def canonical_key(lens: AttachedModel, key: Any) -> Key:
    """The key with canonical site names; a one-line error for a malformed cross-layer key."""
    if isinstance(key, str):
        return _fit_site(lens, key)
    flat = all(isinstance(k, str) for k in key)
    groups = len(key) == 2 and all(isinstance(g, tuple) and g and all(isinstance(s, str) for s in g) for g in key)
    if len(key) < 2 or not (flat or groups):
        raise ValueError(f"a cross-layer key is (source_site, target_site), (site, site, ...) or ((input sites...), "
                         f"(output sites...)); got {key!r}")
    if flat:
        return tuple(_fit_site(lens, k) for k in key)
    return tuple(_fit_site(lens, s) for s in key[0]), tuple(_fit_site(lens, s) for s in key[1])


def _fit_site(lens: AttachedModel, name: str) -> str:
    """The canonical name of a site whose rows have a fixed width; a pattern's grow with the sequence."""
    site = lens.site(name)
    if not all(isinstance(s, int) for s in site.shape[2:]):
        fixed = [n for n, s in lens.sites.items() if all(isinstance(w, int) for w in s.shape[2:])]
        raise ValueError(f"site {site.name!r} has shape ({', '.join(map(str, site.shape))}), whose width grows with the sequence: "
                         f"no extractor can fit it; fit a site of fixed width, e.g. {', '.join(fixed[:4])}")
    return site.name


def where(extractor: Any, key: Key) -> tuple[str, dict[str, Any]]:
    """The site a fitted set's directions live at, and what the fit records of its sites. A pair
    extractor's directions are at the source unless it says `directions_at = "target"` (a
    transcoder's decoder writes the target); a multi-site set (or `directions_at = "sites"`) gets the key's name as a label
    (its directions span several sites: `split_concept_set`)."""
    if isinstance(key, str):
        return key, {"target_site": None}
    if len(key) == 2 and all(isinstance(k, str) for k in key) and not _spans(extractor):  # a crosscoder spans two
        source, target = key_sites(key)
        at = target if getattr(extractor, "directions_at", "source") == "target" else source
        return at, {"source_site": source, "target_site": target}
    if all(isinstance(k, str) for k in key):  # a crosscoder reads and writes every site
        return key_name(key, extractor), {"target_site": None, "sources": list(key), "targets": list(key)}
    return key_name(key), {"target_site": None, "sources": list(key[0]), "targets": list(key[1])}


FORMS = {
    "site": "one site, e.g. blocks.15.resid_out",
    "pair": "a source and a target site joined by '->', e.g. blocks.0.mlp.in->blocks.0.mlp_out",
    "sites": "two or more sites joined by '+', e.g. blocks.3.resid_out+blocks.6.resid_out",
    "groups": "input sites joined by '+', '->', as many output sites, e.g. "
              "blocks.0.mlp.in+blocks.1.mlp.in->blocks.0.mlp_out+blocks.1.mlp_out",
}
"""How a key is spelled in a run config, by the form an extractor reads: one site, a (source,
target) pair (transcoders), several sites (crosscoders), input and output groups (cross-layer
transcoders)."""


def parse_key(text: Any, form: str, what: str = "site") -> Key:
    """A run config's spelling of a key -> the `Key` of that form; a one-line error naming the
    text and the spelling the form needs (the site names themselves are checked by the model)."""
    need = f"{what} must be {FORMS[form]}; got {text!r}"
    if not isinstance(text, str):
        raise ValueError(need)
    sides = [[s.strip() for s in side.split("+")] for side in text.split("->")]
    if any(not s for side in sides for s in side) or len(sides) > 2:
        raise ValueError(need)
    if form == "site" and sides == [sides[0][:1]]:
        return sides[0][0]
    if form == "pair" and len(sides) == 2 and all(len(side) == 1 for side in sides):
        return sides[0][0], sides[1][0]
    if form == "sites" and len(sides) == 1 and len(sides[0]) >= 2:
        return tuple(sides[0])
    if form == "groups" and len(sides) == 2 and len(sides[0]) == len(sides[1]):
        return tuple(sides[0]), tuple(sides[1])
    raise ValueError(need)


def cross_layer(fit_info: Any) -> bool:
    """Whether a set's fit record (`config["fit"]`) says it reads other sites than its directions'
    (a transcoder's source, a crosscoder's or cross-layer transcoder's several sites)."""
    return isinstance(fit_info, dict) and ("source_site" in fit_info or "sources" in fit_info)


@dataclass
class Plan:
    """The extractors of one fit by name, and the sites each reads (`plan_extractors`)."""

    extractors: dict[str, Any]
    """Extractor by name (the site's canonical name, or the user's name for named extractors)."""
    keys: dict[str, Key]
    """Canonical site (or (source, target) pair) each named extractor reads."""
    sites: set[str]
    sequence_aware: set[str] = field(default_factory=set)
    """Pair extractors whose update takes `sequence_ids` (tokens grouped by document)."""
    token_aware: set[str] = field(default_factory=set)
    """Extractors whose update takes `tokens` (a TokenRows)."""


def plan_extractors(lens: AttachedModel, extractors: Mapping[Key, Any]) -> Plan:
    """Resolve every site before any work starts. A key maps to an extractor (named after
    its canonical site) or to `{name: extractor}` (any number per site); two entries that
    end up with one name are an error, never a silent drop."""
    if not extractors:
        raise ValueError("fit needs at least one extractor: {site: extractor}, {site: {name: extractor}} or "
                         "{(source, target): extractor}")
    named: dict[str, Any] = {}
    keys: dict[str, tuple[Key, Key]] = {}  # name -> (canonical key, key as written)
    for key, value in extractors.items():
        canonical = canonical_key(lens, key)
        group = value if isinstance(value, Mapping) else {key_name(canonical, value): value}
        for name, extractor in group.items():
            if not isinstance(name, str) or not is_name(folder(name)):
                raise ValueError(f"extractor name {name!r} at {key!r} is not a safe folder name; {NAME_RULE}")
            if not callable(getattr(extractor, "update", None)):
                raise TypeError(f"extractor {name!r} for {key!r} has no update(x) method: {type(extractor).__name__}")
            if name in named:
                raise ValueError(f"two extractors are named {name!r} (from keys {keys[name][1]!r} and {key!r}, "
                                 f"which read {key_name(keys[name][0], named[name])!r} and "
                                 f"{key_name(canonical, extractor)!r}); give "
                                 "each a distinct name: {site: {name: extractor, ...}}")
            named[name], keys[name] = extractor, (canonical, key)
    sites = {s for key, _ in keys.values() for s in key_sites(key)}
    aware = {name for name, e in named.items() if registry.takes(e, "sequence_ids")}
    tokens = {name for name, e in named.items() if registry.takes(e, "tokens")}
    return Plan(named, {name: k for name, (k, _) in keys.items()}, sites, aware, tokens)
