"""Cross-layer transcoders: planted features of a synthetic multi-layer MLP, causal writes,
bit-identical resume, exact merges, raw-space folding."""

import pytest
import torch

from conceptlens.concepts import ConceptSet
from conceptlens.concepts.sae.clt import CrossLayerTranscoder
from conceptlens.concepts.sae.multisite_io import multisite_from_concept_set

from tests.conftest import roundtrip

L, N_FEATURES, ACTIVE, D_IN, D_OUT = 3, 16, 2, 24, 20
SMALL = dict(width=16, k=2, batch_size=64, warmup_tokens=100, buffer_size=128, dead_after=200)


def planted_clt(n: int, seed: int = 0):
    """L layers, each with N_FEATURES sparse features (ACTIVE per token, f in [0.5, 1.5]) read at its
    MLP input, x_l = f_l E_l + 1; feature i of layer l writes D[l, i, l'] to every output l' >= l:
    y_l' = sum_{l <= l'} f_l D[l, :, l'] + 0.3."""
    g = torch.Generator().manual_seed(seed)
    E = torch.nn.functional.normalize(torch.randn(L, N_FEATURES, D_IN, generator=g), dim=-1)
    D = torch.nn.functional.normalize(torch.randn(L, N_FEATURES, L, D_OUT, generator=g), dim=-1)
    xs, ys = [], [torch.full((n, D_OUT), 0.3) for _ in range(L)]
    for layer in range(L):
        chosen = torch.rand(n, N_FEATURES, generator=g).argsort(1)[:, :ACTIVE]
        f = torch.zeros(n, N_FEATURES).scatter(1, chosen, 0.5 + torch.rand(n, ACTIVE, generator=g))
        xs.append(f @ E[layer] + 1.0)
        for target in range(layer, L):
            ys[target] = ys[target] + f @ D[layer, :, target]
    return xs, ys, D


def recovered(D, directions, cos=0.9):
    """Per layer: share of its planted features whose writes to layers l..L (concatenated) some
    latent of that layer matches."""
    n = directions.shape[0] // L
    shares = []
    for layer in range(L):
        atoms = D[layer, :, layer:].reshape(N_FEATURES, -1)
        rows = directions[layer * n:(layer + 1) * n, layer * D_OUT:]
        sims = torch.nn.functional.normalize(atoms, dim=1) @ torch.nn.functional.normalize(rows, dim=1).T
        shares.append((sims.max(1).values > cos).float().mean().item())
    return shares


def test_clt_recovers_planted_cross_layer_features():
    xs, ys, D = planted_clt(14_000)
    clt = CrossLayerTranscoder(width=L * 48, k=ACTIVE, batch_size=64, warmup_tokens=512, seed=0)  # default lr
    for _ in range(4):
        for a, b in zip(zip(*[x[:12_000].split(1000) for x in xs]), zip(*[y[:12_000].split(1000) for y in ys])):
            clt.update(a, b)
    cs = clt.concept_set()
    shares, fvus = recovered(D, cs.directions), clt.fvu([x[12_000:] for x in xs], [y[12_000:] for y in ys])
    print("CLT: planted features recovered per layer " + ", ".join(f"{s:.0%}" for s in shares)
          + "; held-out FVU per target " + ", ".join(f"{v:.3f}" for v in fvus))
    assert min(shares) >= 0.9
    assert max(fvus) < 0.1
    n = cs.directions.shape[0] // L  # no latent writes a layer before its own
    for layer in range(1, L):
        assert cs.directions[layer * n:(layer + 1) * n, : layer * D_OUT].abs().max() == 0


def chunks(n_chunks=12, seed=0, layers=2):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(20, 90, (n_chunks,), generator=g).tolist()
    out = []
    for n in sizes:
        xs = tuple(3 + 5 * torch.randn(n, 10, generator=g).relu() for _ in range(layers))
        ys = tuple((x[:, :6] * 2 - 1).relu() + 0.1 * torch.randn(n, 6, generator=g) for x in xs)
        out.append((xs, ys))
    return out


def feed(clt, parts):
    for xs, ys in parts:
        clt.update(xs, ys)
    return clt



@pytest.mark.parametrize("cut", [1, 6])  # during warm-up, and after several steps
def test_resume_is_bit_identical(cut):
    parts = chunks()
    full = feed(CrossLayerTranscoder(**SMALL), parts)
    first = feed(CrossLayerTranscoder(**SMALL), parts[:cut])
    resumed = CrossLayerTranscoder(**SMALL)
    resumed.load_state_dict(roundtrip(first.state_dict()))
    feed(resumed, parts[cut:])
    assert full.stats().steps > 5
    for key in full.params:
        assert torch.equal(full.params[key], resumed.params[key]), key
    assert full.stats() == resumed.stats()
    probe = chunks(1, seed=9)[0][0]
    for a, b in zip(full.reconstruct(probe), resumed.reconstruct(probe)):
        assert torch.equal(a, b)


def test_merge_averages_replicas_and_pools_warm_ups():
    base = feed(CrossLayerTranscoder(**SMALL), chunks()[:4])
    a, b = CrossLayerTranscoder(**SMALL), CrossLayerTranscoder(**SMALL)
    a.load_state_dict(base.state_dict())
    b.load_state_dict(base.state_dict())
    feed(a, chunks(seed=1)[:5])
    feed(b, chunks(seed=2)[:5])
    expected = {k: (a.params[k] + b.params[k]).detach() / 2 for k in a.params}
    expected["W_dec"] = expected["W_dec"] / expected["W_dec"].norm(dim=1, keepdim=True)  # rows back at unit norm
    a.merge(b.state_dict())
    for key, value in expected.items():
        torch.testing.assert_close(a.params[key].detach(), value)
    parts = chunks()
    xs, ys = [torch.cat(t) for t in zip(*[p[0] for p in parts])], [torch.cat(t) for t in zip(*[p[1] for p in parts])]
    cut = lambda lo, hi: (tuple(x[lo:hi] for x in xs), tuple(y[lo:hi] for y in ys))  # noqa: E731
    one = feed(CrossLayerTranscoder(**SMALL), [cut(0, 60), cut(60, 100)])  # warm-up: 100 rows
    c, d = feed(CrossLayerTranscoder(**SMALL), [cut(0, 60)]), feed(CrossLayerTranscoder(**SMALL), [cut(60, 100)])
    assert c.scale is None and d.scale is None
    c.merge(d)
    torch.testing.assert_close(c.buffer_dict["site_scale"], one.buffer_dict["site_scale"], rtol=0, atol=0)


def test_raw_space_matches_the_definition():
    """y_hat_l' = sum_{l <= l'} z_l W_dec^{l->l'} + b_dec^l', z_l = TopK(x_l W_enc^l + b_enc^l), from the
    exported weights alone, and the same as the training space's prediction rescaled."""
    clt = feed(CrossLayerTranscoder(**SMALL), chunks())
    xs = chunks(1, seed=5)[0][0]
    cs = clt.concept_set()
    enc, n = cs.encoder, 8
    z = []
    for layer in range(2):
        pre = xs[layer] @ enc["W_enc"][layer] + enc["b_enc"][layer]
        values, idx = pre.topk(2, dim=-1)
        z.append(torch.zeros_like(pre).scatter(-1, idx, values.relu()))
    W = cs.directions  # (16, 12): latents of layer 0 then 1; outputs of layer 0 then 1
    y0 = z[0] @ W[:n, :6] + enc["b_dec"][:6]
    y1 = z[0] @ W[:n, 6:] + z[1] @ W[n:, 6:] + enc["b_dec"][6:]
    got = clt.reconstruct(xs)
    torch.testing.assert_close(got[0], y0, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], y1, rtol=1e-4, atol=1e-4)
    w, c = clt._weights(), clt.columns()
    with torch.no_grad():
        _, code, y_n = clt._forward(torch.cat([*xs, *got], 1) * c, w)
    torch.testing.assert_close(torch.cat(got, 1), y_n / c[20:], rtol=1e-4, atol=1e-4)
    assert cs.config["layers"] == 2 and cs.encoder["W_enc"].shape == (2, 10, 8)


def test_bad_input_is_named():
    clt = CrossLayerTranscoder(**SMALL)
    with pytest.raises(TypeError, match="inputs, outputs"):
        clt.update(torch.zeros(4, 10), torch.zeros(4, 6))
    with pytest.raises(ValueError, match="as many output sites"):
        clt.update((torch.zeros(4, 10),) * 2, (torch.zeros(4, 6),))
    with pytest.raises(ValueError, match="does not split evenly over 5 layers"):
        CrossLayerTranscoder(**SMALL).update((torch.ones(4, 10),) * 5, (torch.ones(4, 6),) * 5)
    clt.update((torch.ones(4, 10),) * 2, (torch.ones(4, 6),) * 2)
    with pytest.raises(ValueError, match="widths"):
        clt.update((torch.ones(4, 9),) * 2, (torch.ones(4, 6),) * 2)


def test_saved_set_rebuilds_the_same_clt(tmp_path):
    """SAELens 6.54 has no CLT class (it reads a Gemma Scope 2 CLT layer as a transcoder with summed
    decoders, which cannot reconstruct): the round trip is through our own ConceptSet files."""
    clt = feed(CrossLayerTranscoder(**SMALL), chunks())
    clt.concept_set().save(tmp_path / "clt")
    rebuilt = multisite_from_concept_set(ConceptSet.load(tmp_path / "clt"))
    xs = chunks(1, seed=5)[0][0]
    assert torch.equal(rebuilt.encode(xs), clt.encode(xs))
    for a, b in zip(rebuilt.reconstruct(xs), clt.reconstruct(xs)):
        assert torch.equal(a, b)
