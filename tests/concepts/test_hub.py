"""ConceptSet.from_pretrained / push_to_hub, offline: a local folder laid out as a Hub repo,
huggingface_hub's own cache read with local_files_only, and the folder a push would upload."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conceptlens import ConceptSet
from conceptlens.concepts.hub import model_card
from conceptlens.concepts.sae import TopKSAE, export_saelens

COMMIT = "0123456789abcdef0123456789abcdef01234567"
# repo ids that resolve from the hand-made Hub cache below (HF_HUB_OFFLINE): nothing is downloaded
CONCEPTS_REPO, SAES_REPO, MISSING_REPO = "someone/concepts", "someone/saes", "someone/missing"


def _cs(site="blocks.3.resid_out") -> ConceptSet:
    g = torch.Generator().manual_seed(0)
    return ConceptSet(torch.randn(5, 8, generator=g), site, method="kmeans", model="HuggingFaceTB/SmolLM2-135M",
                      config={"n_concepts": 5, "fit": {"tokens": 1234, "data": "bbc-news"}})


def _hub_cache(cache: Path, repo_id: str, files_from: Path, subfolder: str) -> None:
    """Lay files out exactly as huggingface_hub's cache does (snapshots/<commit>/..., refs/main)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(files_from, repo / "snapshots" / COMMIT / subfolder)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)


def test_local_repo_folder_with_subfolders(tmp_path):
    cs = _cs()
    cs.save(tmp_path / "repo" / "blocks.3.resid_out")
    back = ConceptSet.from_pretrained(tmp_path / "repo", subfolder="blocks.3.resid_out")
    assert torch.equal(back.directions, cs.directions) and back.site == cs.site and back.model == cs.model
    with pytest.raises(FileNotFoundError, match="holds no ConceptSet"):
        ConceptSet.from_pretrained(tmp_path / "repo")


def test_hub_cache_offline_ours_and_saelens(tmp_path, monkeypatch):
    cs = _cs()
    cs.save(tmp_path / "src" / "ours")
    sae = TopKSAE(width=16, k=3, batch_size=100, warmup_tokens=100, buffer_size=100, seed=0)
    sae.update(torch.randn(400, 8, generator=torch.Generator().manual_seed(1)))
    sae_cs = sae.concept_set()
    sae_cs.site = "blocks.1.resid_out"
    export_saelens(sae_cs, tmp_path / "src" / "sae")
    cache = tmp_path / "hub"
    _hub_cache(cache, CONCEPTS_REPO, tmp_path / "src" / "ours", "blocks.3.resid_out")
    _hub_cache(cache, SAES_REPO, tmp_path / "src" / "sae", "layer_1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ours = ConceptSet.from_pretrained(CONCEPTS_REPO, subfolder="blocks.3.resid_out", cache_dir=cache)
    assert torch.equal(ours.directions, cs.directions)
    theirs = ConceptSet.from_pretrained(SAES_REPO, subfolder="layer_1", cache_dir=cache,
                                        local_files_only=True)
    assert theirs.method == "topk" and theirs.site == "blocks.1.resid_out"
    assert torch.equal(theirs.directions, sae_cs.directions)
    with pytest.raises(FileNotFoundError, match="not in the Hub cache"):
        ConceptSet.from_pretrained(MISSING_REPO, cache_dir=cache, local_files_only=True)
    with pytest.raises(FileNotFoundError, match="neither a local folder nor a Hub repo id"):
        ConceptSet.from_pretrained("no such folder//x", cache_dir=cache, local_files_only=True)


def test_push_uploads_the_set_and_a_model_card(tmp_path, monkeypatch):
    import huggingface_hub

    sent = {}

    def create_repo(self, repo_id, **kwargs):
        sent["created"] = repo_id

    def upload_folder(self, *, repo_id, folder_path, commit_message=None, **kwargs):
        sent["files"] = sorted(str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file())
        sent["card"] = (Path(folder_path) / "README.md").read_text()
        sent["back"] = ConceptSet.load(Path(folder_path) / "blocks.3.resid_out")
        return "ok"

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    cs = _cs()
    assert cs.push_to_hub("someone/concepts", subfolder="blocks.3.resid_out") == "ok"
    assert sent["created"] == "someone/concepts"
    assert {"README.md", "blocks.3.resid_out/config.json", "blocks.3.resid_out/concepts.safetensors"} <= set(
        sent["files"])
    assert torch.equal(sent["back"].directions, cs.directions)
    card = sent["card"]
    for text in ("HuggingFaceTB/SmolLM2-135M", "`blocks.3.resid_out`", "kmeans", "bbc-news", "1,234",
                 "base_model: \"HuggingFaceTB/SmolLM2-135M\""):
        assert text in card, text


def test_model_card_has_no_base_model_for_local_paths():
    cs = _cs()
    cs.model = "/home/me/models/llama"
    assert "base_model" not in model_card(cs)


@pytest.mark.parametrize("subfolder", ["../other", "..", ".", "a/../../other", "/tmp/other", "a\\b", "a//b", ".git"])
def test_subfolder_outside_the_repo_is_refused(tmp_path, subfolder):
    cs = _cs()
    cs.save(tmp_path / "other")  # a set beside the repo: "../other" would read it
    (tmp_path / "repo").mkdir()
    with pytest.raises(ValueError, match="is not a path inside the repo"):
        ConceptSet.from_pretrained(tmp_path / "repo", subfolder=subfolder)


def test_push_to_a_subfolder_outside_the_upload_is_refused(tmp_path, monkeypatch):
    import tempfile

    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, *a, **k: calls.append("create"))
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", lambda self, *a, **k: calls.append("upload"))
    (tmp_path / "a" / "b").mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "a" / "b"))  # "../../x" of the upload folder: tmp_path/a/x
    with pytest.raises(ValueError, match="'../../x' is not a path inside the repo"):
        _cs().push_to_hub("someone/concepts", subfolder="../../x")
    assert calls == [] and not list(tmp_path.rglob("*.safetensors"))
