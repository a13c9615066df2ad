"""A token far above the typical norm, but under the row filter's bar, must not take over dense concepts."""

from __future__ import annotations

import torch

import conceptlens
from conceptlens.concepts.kmeans import StreamingKMeans
from tests.conftest import tiny_model
from tests.describe.test_describe import DOCS, SITE, Tok, captured

PLANTED = ":"  # once per document ("doc 3: ccccc the end")


def _planted_lens(factor: float = 5.0):
    """The tiny Llama with a shared offset in every embedding row (as real residual streams have a
    large mean that centroids point along) and the row of PLANTED then scaled by `factor`."""
    model, tok = tiny_model("llama"), Tok()
    token = tok([PLANTED])["input_ids"][0][0]
    emb = model.model.embed_tokens.weight
    with torch.no_grad():
        offset = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(0))
        emb += offset * 3 * emb.norm(dim=1).median() / offset.norm()
        emb[token] *= factor
    return conceptlens.attach(model, tok), token


def test_a_huge_norm_token_does_not_head_the_dense_concepts():
    lens, token = _planted_lens()
    x, doc, pos, ids = captured(lens, DOCS)
    planted = ids[doc, pos] == token
    ratio = x.norm(dim=1)[planted].min() / x.norm(dim=1).median()
    assert 2 < ratio < 10  # far above the typical token, yet under the row filter's bar (10x the median)
    cs = lens.fit({SITE: StreamingKMeans(8, seed=0)}, DOCS * 2, max_length=16, progress=False).concepts[SITE]
    # the old measure, the projection on the raw direction, is taken over by the planted token
    projection = x @ torch.nn.functional.normalize(cs.directions, dim=1).T
    assert planted[projection.argmax(0)].sum() >= 6
    d = lens.describe({"km": cs}, DOCS, max_length=16, progress=False, top_n=4, window=(3, 2))["km"]
    heads = [ctx["contexts"][0] for ctx in d.contexts]
    by_planted = sum(c["tokens"][c["center"]] == PLANTED for c in heads)
    assert by_planted <= 2  # at most the concepts that are about it (k-means may give it a cluster)
    norms = d.info["norms"]
    assert norms["largest"][0][0] == PLANTED and norms["filtered"]["norm_outlier"] == 0
    share = x.norm(dim=1)[planted].pow(2).sum() / x.norm(dim=1).pow(2).sum()
    assert share > planted.float().mean() * 4  # what the variance share below is about
    assert norms["top_share"] > norms["top_fraction"] * 4


def test_describe_warns_when_one_token_heads_many_concepts_or_norms_dominate():
    from types import SimpleNamespace

    from conceptlens.commands.describe import warnings

    def described(heads, norms):
        contexts = [{"concept": i, "contexts": [{"tokens": ["a", t], "center": 1}]} for i, t in enumerate(heads)]
        return SimpleNamespace(contexts=contexts, info={"n_concepts": len(heads), "site": "s", "norms": norms})

    quiet = described(["x", "y", "z", "x"], {"dominated": False})  # "x" heads 2 of 4 concepts, more than 25%
    assert warnings({"q": described(["x", "y", "z", "w"], {"dominated": False})}) == []
    assert warnings({"q": quiet}) == ["'x' is the first top token of 2 of the 4 q concepts"]
    loud = described(["x", "y", "z", "w"], {"dominated": True, "top_share": 0.74, "largest": [["'", 61]]})
    assert warnings({"a": loud, "b": loud}) == ["at s the 1% largest-norm tokens carry 74% of the variance "
                                                "(largest: \"'\" x61)"]  # once per site
