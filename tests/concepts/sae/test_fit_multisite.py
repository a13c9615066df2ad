"""fit feeds several sites per row: crosscoder keys (site, site, ...) and cross-layer transcoder
keys ((inputs...), (outputs...)); each set is labelled with where its directions live."""

import json

import pytest
import torch

import conceptlens
from conceptlens.concepts import ConceptSet
from conceptlens.concepts.sae.clt import CrossLayerTranscoder
from conceptlens.concepts.sae.crosscoder import Crosscoder, split_concept_set
from conceptlens.concepts.sae.transcoder import Transcoder
from conceptlens.concepts.sae.transcoder_io import export_transcoder
from tests.conftest import CharTokenizer, tiny_model

TEXTS = [f"document {i} says {'abc' * (i % 4)} and more" for i in range(12)]
INS, OUTS = ("blocks.0.mlp.in", "blocks.1.mlp.in"), ("blocks.0.mlp_out", "blocks.1.mlp_out")


class Recorder:
    def __init__(self):
        self.calls = []

    def update(self, *args):
        self.calls.append(args)


def _lens():
    return conceptlens.attach(tiny_model("llama"), CharTokenizer())


def test_multi_site_keys_get_the_rows_each_site_gets_alone():
    lens = _lens()
    alone = {site: Recorder() for site in (*INS, *OUTS)}
    cross, groups = Recorder(), Recorder()
    lens.fit({**alone, INS + OUTS[:1]: cross, (INS, OUTS): groups}, TEXTS, batch_size=4, max_length=16,
             progress=False)
    rows = {site: torch.cat([c[0] for c in r.calls]) for site, r in alone.items()}
    for i, site in enumerate(INS + OUTS[:1]):
        assert torch.equal(torch.cat([c[i] for c in cross.calls]), rows[site])
    for g, group in enumerate((INS, OUTS)):
        for i, site in enumerate(group):
            assert torch.equal(torch.cat([c[g][i] for c in groups.calls]), rows[site])


def test_sets_are_labelled_where_their_directions_live(tmp_path):
    lens = _lens()
    small = dict(batch_size=16, warmup_tokens=16, buffer_size=32)
    extractors = {(INS[0], OUTS[0]): Transcoder(width=8, **small),
                  ("blocks.0.resid_out", "blocks.1.resid_out"): Crosscoder(width=8, k=2, **small),
                  (INS, OUTS): CrossLayerTranscoder(width=8, k=2, **small)}
    report = lens.fit(extractors, TEXTS, batch_size=4, max_length=16, progress=False, checkpoint_dir=str(tmp_path))
    tc = report.concepts["blocks.0.mlp.in->blocks.0.mlp_out"]
    assert tc.site == "blocks.0.mlp_out"  # a transcoder's decoder rows live at its target
    assert tc.config["fit"]["source_site"] == "blocks.0.mlp.in" and tc.config["fit"]["target_site"] == "blocks.0.mlp_out"
    meta = json.loads((export_transcoder(tc, tmp_path / "saelens") / "cfg.json").read_text())["metadata"]
    # mlp.in has no TransformerLens twin (ln2.hook_normalized is before the norm's weight): our name stays
    assert (meta["hook_name"], meta["hook_name_out"]) == ("blocks.0.mlp.in", "blocks.0.hook_mlp_out")
    cc = report.concepts["blocks.0.resid_out+blocks.1.resid_out"]  # spanning both sites: no source and target
    assert cc.site == "blocks.0.resid_out+blocks.1.resid_out"
    assert cc.config["fit"]["targets"] == ["blocks.0.resid_out", "blocks.1.resid_out"]
    assert list(split_concept_set(cc)) == cc.config["fit"]["targets"]
    clt = report.concepts["blocks.0.mlp.in+blocks.1.mlp.in->blocks.0.mlp_out+blocks.1.mlp_out"]
    assert clt.config["fit"]["sources"] == list(INS) and clt.config["fit"]["targets"] == list(OUTS)
    parts = split_concept_set(clt)
    assert [p.site for p in parts.values()] == list(OUTS)
    saved = ConceptSet.load(tmp_path / "concepts" / "blocks.0.mlp.in__and__blocks.1.mlp.in__to__blocks.0.mlp_out__and__"
                                                     "blocks.1.mlp_out")
    assert torch.equal(saved.directions, clt.directions)


def test_a_malformed_key_is_named():
    lens = _lens()
    with pytest.raises(ValueError, match="a cross-layer key is"):
        lens.fit({(INS, OUTS[0]): Recorder()}, TEXTS, progress=False)
