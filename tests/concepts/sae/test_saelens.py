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
    ("transformer.h.3.attn", "blocks.3.attn_out"), ("model.norm", "final"),
    ("ln_final.hook_normalized", "ln_final.hook_normalized"), ("hook_embed", "hook_embed"),
    ("blocks.0.hook_resid_pre", "blocks.0.resid_in"), ("something.else", "something.else"),
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


def test_every_hook_name_we_map_holds_the_same_tensor_as_in_transformerlens():
    """GPT-2 with non-trivial LayerNorm weights, in HF and (the same weights, no processing, as SAELens 6
    loads models) in TransformerLens: each site we name by a TransformerLens hook reads that hook's
    tensor. `ln2.hook_normalized` (before the norm's weight) and `hook_embed` (without the position
    embedding) were mapped to `mlp.in` and `embed`: 0.6 relative apart."""
    pytest.importorskip("sae_lens")
    tl = pytest.importorskip("transformer_lens")
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights
    from transformers import GPT2Config, GPT2LMHeadModel

    import conceptlens
    from conceptlens.concepts.sae.saelens import HOOKS, site_from_hook_name

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=100)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "ln_" in name:
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if name.endswith("weight") else 0.0))
    cfg = tl.HookedTransformerConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=128, d_vocab=100, n_ctx=64,
                                     act_fn="gelu_new", normalization_type="LN")
    model = tl.HookedTransformer(cfg)
    model.load_state_dict(convert_gpt2_weights(hf, cfg), strict=False)
    ids = torch.randint(0, 100, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, cache = model.eval().run_with_cache(ids)
    sites = ["embed", *(f"blocks.{i}.{name}" for i in (0, 1) for name in HOOKS), "blocks.1.mlp.in", "final"]
    with conceptlens.attach(hf).capture(sites) as capture:
        acts, _ = capture.forward(input_ids=ids, attention_mask=torch.ones_like(ids))
    mapped = {site: hook_name(site) for site in sites if hook_name(site) != site}
    assert sorted(mapped) == sorted(set(sites) - {"blocks.1.mlp.in", "final"})
    for site, hook in mapped.items():
        torch.testing.assert_close(acts[site].reshape(-1, 32), cache[hook].reshape(-1, 32), rtol=1e-5, atol=1e-5)
        assert site_from_hook_name(hook) in (site, "blocks.0.resid_in")  # embed is block 0's input
    for hook in ("blocks.1.ln2.hook_normalized", "ln_final.hook_normalized", "hook_embed"):  # no site holds these
        assert site_from_hook_name(hook) == hook


def test_a_config_from_before_saelens_6_reads_as_saelens_reads_it(tmp_path):
    sae_lens = pytest.importorskip("sae_lens")
    _theirs("topk", tmp_path, k=4, rescale_acts_by_decoder_norm=False)
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    for key in ("architecture", "k", "metadata"):
        cfg.pop(key)
    cfg |= {"activation_fn_str": "topk", "activation_fn_kwargs": {"k": 4}, "hook_point": "blocks.1.hook_resid_post",
            "model_name": "gpt2"}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    theirs = sae_lens.SAE.load_from_disk(tmp_path)
    cs = import_saelens(tmp_path)
    assert cs.method == "topk" and cs.config["k"] == 4 and cs.site == "blocks.1.resid_out"
    x = torch.randn(64, D_IN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(sae_from_concept_set(cs).encode(x), theirs.encode(x), rtol=1e-5, atol=1e-5)
    # SAELens 4-5 wrote architecture "standard" beside a topk activation; its version decides, as SAELens does
    (tmp_path / "cfg.json").write_text(json.dumps({**cfg, "architecture": "standard", "sae_lens_version": "5.9.1"}))
    assert type(sae_lens.SAE.load_from_disk(tmp_path)).__name__ == "TopKSAE"
    cs = import_saelens(tmp_path)
    assert cs.method == "topk" and cs.config["k"] == 4
    (tmp_path / "cfg.json").write_text(json.dumps({**cfg, "activation_fn_str": "tanh-relu"}))
    with pytest.raises(ValueError, match="activation 'tanh-relu' .* not supported; supported: relu, topk"):
        import_saelens(tmp_path)
