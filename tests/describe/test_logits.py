"""Promoted and suppressed tokens through the bfloat16 screen against a stable sort of every exact logit."""

import pytest
import torch

from conceptlens.describe.logits import Unembedding, _dots, logit_tokens

P = 10
V = 17_000  # 265 whole groups of 64 tokens (the group search runs) and a tail of 40


def _reference(directions, w_u, p):
    """A stable sort of every float64 logit of the unit directions (equal logits in column order)."""
    logits = torch.nn.functional.normalize(directions.float(), dim=1).double() @ w_u.double().T
    out = {}
    for name, descending in (("promoted", True), ("suppressed", False)):
        order = logits.sort(dim=1, descending=descending, stable=True).indices[:, :p]
        out[f"{name}_ids"], out[f"{name}_logit"] = order, logits.gather(1, order)
    return out, logits


def _dyadic(g, shape, bits, scale=1.0):
    """Random multiples of 2^-bits in [-scale, scale): every sum below stays exact in float32."""
    return torch.randint(-int(scale * 2 ** bits), int(scale * 2 ** bits), shape, generator=g).float() / 2 ** bits


def _unit_rows(g, n, d, nonzero=16):
    """Directions whose float32 norm is exactly 1 (16 entries of +-1/4): normalising them changes nothing."""
    x = torch.zeros(n, d)
    for row in x:
        row[torch.randperm(d, generator=g)[:nonzero]] = torch.where(torch.rand(nonzero, generator=g) < 0.5, -0.25, 0.25)
    return x


def _exact_case(name):
    """Directions and an unembedding whose every logit is exact in float32, in any summation order."""
    g = torch.Generator().manual_seed(11)
    d = 48
    if name == "ties":  # few distinct logits: equal logits across the p-th and the candidates' edge
        w_u = torch.randint(-3, 4, (V, d), generator=g).float()
    elif name == "near ties":  # logits 2^-14 apart, where the bfloat16 screen sees steps of 2^-4
        w_u = torch.randint(-8, 8, (V, d), generator=g).float() + _dyadic(g, (V, d), 12, 2 ** -6)
    elif name == "huge-norm tokens":  # the bound is wide: most rows go on to the float32 screen
        w_u = _dyadic(g, (V, d), 8, 4.0)
        w_u[::97] *= 2 ** 10
    elif name == "massive dimension":  # one coordinate 256x the others in every token
        w_u = _dyadic(g, (V, d), 8, 4.0)
        w_u[:, 5] *= 2 ** 8
    else:  # every logit of a row equal (each row searched whole), and zero directions
        dirs = _unit_rows(g, 20, d)
        dirs[::3] = 0.0
        return dirs, torch.ones(V, d)
    return _unit_rows(g, 100, d), w_u


@pytest.mark.parametrize("name", ["ties", "near ties", "huge-norm tokens", "massive dimension", "all equal"])
def test_screen_equals_a_stable_sort_of_exact_logits(name):
    dirs, w_u = _exact_case(name)
    ref, _ = _reference(dirs, w_u, P)
    got = logit_tokens(dirs, w_u, P, chunk=32, screen=True)
    for key in ref:
        assert torch.equal(got[key].double() if "logit" in key else got[key], ref[key]), key


def test_screen_equals_the_plain_path_on_random_and_heavy_rows():
    """Gaussian unembedding and directions, some with one massive coordinate: on rows without a near
    tie that float32 rounding could reorder, ids equal to the plain float32 path's and the float64
    sort's; on every row, the exact logits of the ids found within float32's bound of the top p."""
    g = torch.Generator().manual_seed(12)
    d = 48
    w_u = torch.randn(V, d, generator=g) * torch.rand(V, 1, generator=g) * 3
    dirs = torch.randn(200, d, generator=g)
    dirs[:50, 7] *= 300.0  # a massive dimension
    ref, logits = _reference(dirs, w_u, P + 1)
    bound = d * 2.0 ** -24 * w_u.double().norm(dim=1).max() * 1.01  # |float32 dot - exact| for unit rows
    plain = logit_tokens(dirs, w_u, P, chunk=64, screen=False)
    screened = logit_tokens(dirs, Unembedding(w_u), P, chunk=64, screen=True)
    for key in ("promoted", "suppressed"):
        clear = (ref[f"{key}_logit"].diff(dim=1).abs() > 2 * bound).all(1)
        assert clear.float().mean() > 0.9
        for got in (screened, plain):
            assert torch.equal(got[f"{key}_ids"][clear], ref[f"{key}_ids"][clear, :P])
            assert ((logits.gather(1, got[f"{key}_ids"]) - ref[f"{key}_logit"][:, :P]).abs() <= 2 * bound).all()
        assert ((screened[f"{key}_logit"].double() - ref[f"{key}_logit"][:, :P]).abs() <= 3 * bound).all()


def test_equal_unembedding_rows_are_listed_by_token_id_through_the_screen():
    g = torch.Generator().manual_seed(13)
    w_u = torch.randn(V, 32, generator=g)
    w_u[16_990] *= 50.0  # the most promoted and suppressed token of many directions lies in the tail
    w_u[[40, 9000]] = w_u[16_990].clone()
    dirs = torch.randn(64, 32, generator=g)
    got = logit_tokens(dirs, w_u, 3, chunk=16, screen=True)
    assert (got["promoted_ids"] == torch.tensor([40, 9000, 16_990])).all(1).any()
    top = got["promoted_ids"][:, :3]
    whole = (got["promoted_ids"] == 40).any(1)
    assert torch.equal(top[whole], torch.tensor([40, 9000, 16_990]).expand(int(whole.sum()), 3))
    ties = got["promoted_logit"][whole]
    assert torch.equal(ties[:, 0], ties[:, 1]) and torch.equal(ties[:, 1], ties[:, 2])  # one dot product each


def test_a_non_finite_direction_gives_non_finite_logits_not_token_zero():
    dirs, w_u = _exact_case("ties")
    dirs = dirs[:4].clone()
    dirs[1, 3], dirs[2, 0] = float("nan"), float("inf")
    got = logit_tokens(dirs, w_u, P, chunk=32, screen=True)
    for key in ("promoted_logit", "suppressed_logit"):
        assert not got[key][1:3].isfinite().any() and got[key][[0, 3]].isfinite().all()


def test_no_tokens_asked_gives_empty_rows_on_either_path():
    dirs, w_u = _exact_case("ties")
    for screen in (True, False):
        got = logit_tokens(dirs[:5], w_u, 0, screen=screen)
        assert got["promoted_ids"].shape == (5, 0) and got["suppressed_logit"].shape == (5, 0)


def test_the_float32_fallback_holds_when_torch_multiplies_float32_in_lower_precision():
    """Clusters of tokens nearly parallel to each direction: near ties the bfloat16 screen cannot
    certify, so rows reach the fallback screen, which must not trust float32 products that torch may
    compute in bfloat16 ('medium' precision): the ids stay a stable sort of the row's own float32
    logits (each one dot product, as the candidates')."""
    g = torch.Generator().manual_seed(1)
    d, n = 576, 8
    w_u = torch.randn(V, d, generator=g) * 0.05
    dirs = torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1)
    for i in range(n):
        w_u[torch.randperm(V, generator=g)[:2000]] = dirs[i] * 2.0 + 1e-3 * torch.randn(2000, d, generator=g)
    logits = _dots(dirs, w_u, torch.arange(V).expand(n, V).contiguous())  # float32, one dot product each
    want = logits.sort(dim=1, descending=True, stable=True).indices[:, :P]
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        got = logit_tokens(dirs, w_u, P, screen=True)
    finally:
        torch.set_float32_matmul_precision(before)
    assert torch.equal(got["promoted_ids"], want)
