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


# -- files written by SAELens itself: every common layout folds exactly into ours ---------------

D_IN, D_SAE = 12, 24


def _theirs(arch: str, tmp_path, **cfg):
    """A SAELens SAE of `arch` with random weights, saved by SAELens's own save_model."""
    sae_lens = pytest.importorskip("sae_lens")
    from sae_lens.saes.sae import SAEMetadata

    classes = {"standard": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig),
               "topk": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig),
               "jumprelu": (sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig)}
    cls, config_cls = classes[arch]
    meta = SAEMetadata(hook_name=cfg.pop("hook_name", "blocks.1.hook_resid_post"),
                       model_name=cfg.pop("model_name", "gpt2"),
                       model_from_pretrained_kwargs=cfg.pop("tl_kwargs", {}))
    sae = cls(config_cls(d_in=D_IN, d_sae=D_SAE, metadata=meta, **cfg))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in sae.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if name != "threshold" else 0.3))
    sae.save_model(tmp_path)
    return sae


LAYOUTS = {
    "standard": dict(arch="standard"),
    "topk-plain": dict(arch="topk", k=4, rescale_acts_by_decoder_norm=False),
    "topk-training-default": dict(arch="topk", k=4, rescale_acts_by_decoder_norm=True),
    "gemma-scope": dict(arch="jumprelu", apply_b_dec_to_input=False),  # thresholds of both signs
    "jumprelu": dict(arch="jumprelu"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_saelens_files_import_exactly(layout, tmp_path):
    cfg = dict(LAYOUTS[layout])
    theirs = _theirs(cfg.pop("arch"), tmp_path, **cfg)
    cs = import_saelens(tmp_path)
    ours = sae_from_concept_set(cs)
    x = torch.randn(64, D_IN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        z_theirs, z_ours = theirs.encode(x), ours.encode(x)
        torch.testing.assert_close(z_ours, z_theirs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.decode(z_ours), theirs.decode(z_theirs), rtol=1e-5, atol=1e-5)
    assert cs.site == "blocks.1.resid_out" and cs.config["hook_name"] == "blocks.1.hook_resid_post"
    if layout == "gemma-scope":
        assert {"apply_b_dec_to_input", "non_positive_thresholds"} <= set(cs.config["folded"])
        assert (theirs.threshold < 0).any()  # the case that used to import wrong
    if layout == "topk-training-default":
        torch.testing.assert_close(cs.directions.norm(dim=-1), torch.ones(D_SAE))


def test_transformerlens_centring_is_folded_into_the_encoder(tmp_path):
    theirs = _theirs("standard", tmp_path, tl_kwargs={"center_writing_weights": True, "fold_ln": True})
    cs = import_saelens(tmp_path)
    assert cs.config["input_centred_per_token"] and "centre_per_token" in cs.config["folded"]
    ours = sae_from_concept_set(cs)
    raw = 5 + torch.randn(32, D_IN, generator=torch.Generator().manual_seed(5))
    centred = raw - raw.mean(-1, keepdim=True)  # what TransformerLens's processed resid_post holds
    with torch.no_grad():
        torch.testing.assert_close(ours.encode(raw), theirs.encode(centred), rtol=1e-5, atol=1e-5)
    plain = import_saelens(tmp_path, centre=False)
    with torch.no_grad():
        torch.testing.assert_close(sae_from_concept_set(plain).encode(centred), theirs.encode(centred),
                                   rtol=1e-5, atol=1e-5)


def test_refused_layouts_name_the_field(tmp_path):
    _theirs("standard", tmp_path, normalize_activations="layer_norm")
    with pytest.raises(ValueError, match="normalize_activations='layer_norm' is not supported"):
        import_saelens(tmp_path)


@pytest.mark.parametrize("hook, site", [
    ("blocks.5.hook_resid_post", "blocks.5.resid_out"), ("blocks.5.hook_resid_pre", "blocks.5.resid_in"),
    ("blocks.2.hook_mlp_out", "blocks.2.mlp_out"), ("blocks.2.attn.hook_z", "blocks.2.attn.z"),
    ("model.layers.7", "blocks.7.resid_out"), ("model.layers.7.mlp", "blocks.7.mlp_out"),
    ("transformer.h.3.attn", "blocks.3.attn_out"), ("ln_final.hook_normalized", "final"),
    ("something.else", "something.else"),
])
def test_hook_names_map_to_sites_and_back(hook, site):
    from conceptlens.concepts.sae.saelens import site_from_hook_name

    assert site_from_hook_name(hook) == site
    if hook.startswith("blocks.") and hook.split(".")[2].startswith("hook_"):
        assert hook_name(site) == hook


def test_export_names_the_hub_id_of_a_registered_model(tmp_path):
    _, cs = fitted("topk")
    cs.model = "smollm2-135m"
    export_saelens(cs, tmp_path)
    assert json.loads((tmp_path / "cfg.json").read_text())["metadata"]["model_name"] == \
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert import_saelens(tmp_path).model == "smollm2-135m"
