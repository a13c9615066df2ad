"""Checkpoints and concept sets written by older code still load, and training resumes from them
to what that code produced (within float tolerance: the files were written on another run)."""

from pathlib import Path

import pytest
import torch

from conceptlens.concepts import ConceptSet
from conceptlens.concepts.sae import TopKSAE, sae_from_concept_set
from tests.concepts.sae.data.old_states import CASES, CUT, feed, make, stream, written

DATA = Path(__file__).parent / "data"
V1 = DATA / "v1"


@pytest.mark.parametrize("version", ["v1", "v2"])  # before the SAEs were modules; before SAETrainer
@pytest.mark.parametrize("case", CASES)
def test_a_checkpoint_of_the_old_code_resumes_to_its_result(case, version):
    saved = torch.load(DATA / version / f"{case}.pt", weights_only=True)
    extractor = make(case)
    extractor.load_state_dict(saved["state"])
    got = written(feed(extractor, stream(case)[CUT:]))
    want = saved["after"]
    torch.testing.assert_close(got["directions"], want["directions"], rtol=1e-4, atol=1e-5)
    assert got["encoder"].keys() == want["encoder"].keys()
    for key, value in want["encoder"].items():
        torch.testing.assert_close(got["encoder"][key], value, rtol=1e-4, atol=1e-5, msg=key)
    assert got["stats"] == pytest.approx(want["stats"], rel=1e-4, abs=1e-6)


def test_a_set_saved_under_the_old_method_name_reads_under_the_one_name(tmp_path):
    cs = ConceptSet.load(V1 / "topk_set")
    assert cs.method == "topk" == TopKSAE.method
    assert "topk_sae" in (V1 / "topk_set" / "config.json").read_text()  # the file does carry the old name
    sae = sae_from_concept_set(cs)
    assert type(sae) is TopKSAE
    x = stream("topk")[0][0]
    torch.testing.assert_close(sae.concept_set().directions, cs.directions, rtol=0, atol=0)
    assert sae.encode(x).shape == (len(x), len(cs))
    cs.save(tmp_path / "again")
    assert ConceptSet.load(tmp_path / "again").method == "topk"
    assert '"method": "topk"' in (tmp_path / "again" / "config.json").read_text()
