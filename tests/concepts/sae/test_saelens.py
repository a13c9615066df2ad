"""SAELens layout: our round trip always; SAELens itself reading our files when it is installed."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conceptlens.concepts.sae import (BatchTopKSAE, JumpReLUSAE, MatryoshkaSAE, ReLUSAE, SpaDE, TopKSAE,
                                      export_saelens, import_saelens, sae_from_concept_set)
from conceptlens.concepts.sae.saelens import hook_name

SMALL = dict(width=16, batch_size=100, warmup_tokens=100, buffer_size=100, seed=0)
EXPORTABLE = {
    "relu": (lambda: ReLUSAE(**SMALL, l1=0.5), "standard"),
    "topk": (lambda: TopKSAE(**SMALL, k=3), "topk"),
    "jumprelu": (lambda: JumpReLUSAE(**SMALL, threshold_init=0.1, bandwidth=0.05), "jumprelu"),
    "batchtopk": (lambda: BatchTopKSAE(**SMALL, k=3), "jumprelu"),
    "matryoshka": (lambda: MatryoshkaSAE(**SMALL, k=3, prefixes=(4, 16)), "topk"),
}


def fitted(name: str):
    g = torch.Generator().manual_seed(0)
    sae = EXPORTABLE[name][0]()
    sae.update(3 + 2 * torch.randn(500, 12, generator=g))
    cs = sae.concept_set()
    cs.site, cs.model = "blocks.3.resid_out", "tiny-model"
    return sae, cs


@pytest.mark.parametrize("name", EXPORTABLE)
def test_round_trip(name, tmp_path):
    sae, cs = fitted(name)
    export_saelens(cs, tmp_path)
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    weights = load_file(tmp_path / "sae_weights.safetensors")
    assert cfg["architecture"] == EXPORTABLE[name][1] and (cfg["d_in"], cfg["d_sae"]) == (12, 16)
    assert cfg["metadata"]["hook_name"] == "blocks.3.hook_resid_post"
    assert weights["W_enc"].shape == (12, 16) and weights["W_dec"].shape == (16, 12)
    back = import_saelens(tmp_path)
    assert back.site == "blocks.3.resid_out" and back.model == "tiny-model"
    assert torch.equal(back.directions, cs.directions)
    for key in ("W_enc", "b_enc", "b_dec"):
        assert torch.equal(back.encoder[key], cs.encoder[key])
    x = 3 + 2 * torch.randn(50, 12, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(sae_from_concept_set(back).encode(x), sae.encode(x), rtol=1e-5, atol=1e-5)


def test_hook_names_and_refusals(tmp_path):
    assert hook_name("blocks.-1.resid_in") == "blocks.-1.hook_resid_pre"
    assert hook_name("blocks.2.attn.q") == "blocks.2.attn.q"
    g = torch.Generator().manual_seed(0)
    spade = SpaDE(**SMALL)
    spade.update(torch.randn(200, 12, generator=g))
    with pytest.raises(ValueError, match="no layout for method 'spade'"):
        export_saelens(spade, tmp_path / "spade")
    _, cs = fitted("topk")
    export_saelens(cs, tmp_path / "ok")
    cfg = json.loads((tmp_path / "ok" / "cfg.json").read_text())
    (tmp_path / "ok" / "cfg.json").write_text(json.dumps({**cfg, "architecture": "gated"}))
    with pytest.raises(ValueError, match="architecture 'gated' is not supported"):
        import_saelens(tmp_path / "ok")
    with pytest.raises(FileNotFoundError, match="cfg.json"):
        import_saelens(tmp_path / "missing")


@pytest.mark.parametrize("name", EXPORTABLE)
def test_saelens_loads_our_export(name, tmp_path):
    sae_lens = pytest.importorskip("sae_lens")
    sae, cs = fitted(name)
    export_saelens(cs, tmp_path)
    theirs = sae_lens.SAE.load_from_disk(tmp_path)
    x = 3 + 2 * torch.randn(50, 12, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs.encode(x), sae.encode(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(theirs.decode(sae.encode(x)), sae.decode(sae.encode(x)), rtol=1e-5, atol=1e-5)
