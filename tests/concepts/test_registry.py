"""The one table of extractor methods: every extractor class is in it under the name it writes."""

import pytest
import torch

import conceptlens.concepts  # noqa: F401 - imports every extractor class
import conceptlens.concepts.sae  # noqa: F401
from conceptlens.concepts import ConceptSet, registry
from conceptlens.concepts.base import ExtractorBase
from conceptlens.concepts.sae import MPSAE, SparseAutoencoder, TopKSAE, Transcoder


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_extractor_class_is_registered_under_the_name_it_writes():
    own = {cls for cls in _subclasses(ExtractorBase)
           if cls.__module__.startswith("conceptlens.concepts") and "method" in vars(cls)
           and cls is not SparseAutoencoder}  # (the base of the SAE variants, not a method)
    loaded = {m.load() for m in registry.METHODS.values()}
    assert own == loaded
    for name, m in registry.METHODS.items():
        assert m.load().method == name


def test_old_names_map_to_the_one_name_and_never_collide():
    aliases = [a for m in registry.METHODS.values() for a in m.aliases]
    assert len(aliases) == len(set(aliases)) and not set(aliases) & set(registry.METHODS)
    assert registry.canonical("topk_sae") == "topk" and registry.canonical("mp_sae") == "mpsae"
    assert registry.canonical("probe") == "probe"  # a hand-made set keeps its own name
    assert registry.method("cross_layer_transcoder").name == "clt"
    assert ConceptSet(torch.eye(3), method="h_sae").method == "hsae"


def test_an_unknown_method_names_the_choices():
    with pytest.raises(ValueError, match="unknown extractor method 'topq'; choose one of kmeans, deleuzian"):
        registry.method("topq")


def test_capabilities_are_declared_for_registered_classes_and_read_from_update_otherwise():
    assert registry.method("clvq").rows == "pair" and registry.takes(registry.method("clvq").load(), "sequence_ids")
    assert not registry.takes(TopKSAE(width=4, k=1), "tokens")
    assert registry.of(Transcoder) is registry.method("transcoder") and registry.of(MPSAE).k_past_width

    class Mine:
        def update(self, x, *, tokens):
            pass

    assert registry.of(Mine()) is None and registry.takes(Mine(), "tokens")
    assert not registry.takes(Mine(), "sequence_ids")
