"""The description pass's faster kernels against the plain products they replace."""

import pytest
import torch

from conceptlens.describe.describer import _add_outer
from conceptlens.describe.finish import map_xy


def test_sparse_outer_counts_equal_the_dense_product():
    g = torch.Generator().manual_seed(0)
    fired = (torch.rand(40, 30, generator=g) < 0.1).float()  # (rows, n) 0/1
    dense, sparse = torch.full((30, 30), 2.0), torch.full((30, 30), 2.0)  # accumulates onto earlier sums
    _add_outer(dense, fired, sparse=False)
    _add_outer(sparse, fired, sparse=True)
    assert torch.equal(sparse, dense) and torch.equal(dense - 2.0, fired.T @ fired)


def test_map_xy_axes_have_a_fixed_sign():
    g = torch.Generator().manual_seed(1)
    for dirs in (torch.randn(20, 5, generator=g), torch.randn(5, 20, generator=g)):
        xy = map_xy(dirs)
        assert torch.all(xy.gather(0, xy.abs().argmax(0, keepdim=True)) > 0)
        torch.testing.assert_close(map_xy(-dirs), xy)  # every direction negated: the same picture


def test_coarse_bin_counts_equal_the_fine_bins_of_every_value():
    from conceptlens.describe.describer import FINE, _count_bins, fine_bins
    from conceptlens.describe.topn import order_key

    g = torch.Generator().manual_seed(2)
    z = torch.randn(300, 7, generator=g) * torch.exp2(torch.randint(-24, 24, (300, 7), generator=g).float())
    z[::5] = 0.0  # exact zeros, signed zeros and values past both ends of the fine range
    z[1, :3] = torch.tensor([-0.0, 1e30, -1e-30])
    key = order_key(z)
    hist = torch.full((7, FINE), 3, dtype=torch.long)  # adds onto earlier counts
    _count_bins(hist, key)
    by_hand = torch.stack([torch.bincount(fine_bins(key[:, c]), minlength=FINE) for c in range(7)])
    assert torch.equal(hist - 3, by_hand)


def test_map_xy_is_the_two_leading_principal_components():
    g = torch.Generator().manual_seed(3)
    for dirs in (torch.randn(40, 6, generator=g) * torch.arange(1, 7), torch.randn(6, 40, generator=g)):
        unit = torch.nn.functional.normalize(dirs.double(), dim=1)
        centred = unit - unit.mean(0)
        u, s, _ = torch.linalg.svd(centred, full_matrices=False)
        ref = u[:, :2] * s[:2]  # PCA scores, up to each axis's sign
        ref = ref * torch.where(ref.gather(0, ref.abs().argmax(0, keepdim=True)) < 0, -1.0, 1.0)
        torch.testing.assert_close(map_xy(dirs).double(), ref, atol=1e-5, rtol=1e-4)


def _contexts_before(describer, tokenizer):
    """decode_contexts as it was before the used slots were read back alone (the reference)."""
    from conceptlens.describe.finish import chips, decoder, used_slots

    top = describer.top
    values, doc, pos = used_slots(describer)
    ids, acts = top.window_ids.cpu(), top.window_acts.cpu().double()
    scale = torch.pow(10.0, 4 - torch.floor(torch.log10(acts.abs().clamp(min=1e-30))))
    acts = torch.where(acts == 0, 0.0, torch.round(acts * scale) / scale)
    vocab = decoder(tokenizer, ids[ids >= 0].unique().tolist())
    lines = []
    for c in range(describer.n):
        contexts = []
        for j in range(top.k):
            if doc[c, j] < 0:
                break
            row = ids[c, j].tolist()
            keep = [t >= 0 for t in row]
            kept_acts = [a for a, k in zip(acts[c, j].tolist(), keep) if k]
            tokens, row_acts, center = chips(tokenizer, [t for t in row if t >= 0], kept_acts,
                                             top.window[0] - keep.index(True), vocab)
            contexts.append({"value": float(values[c, j]), "doc": int(doc[c, j]), "pos": int(pos[c, j]),
                             "center": center, "tokens": tokens, "acts": row_acts})
        lines.append({"concept": c, "contexts": contexts})
    return lines


def test_contexts_equal_the_plain_loop_over_every_slot():
    import conceptlens
    from conceptlens import ConceptSet
    from conceptlens.concepts.sae import TopKSAE
    from conceptlens.describe import ConceptDescriber
    from conceptlens.describe.finish import decode_contexts
    from tests.conftest import tiny_model
    from tests.describe.test_describe import DOCS, NO_NORM, SITE, Tok

    class Split(Tok):
        """Two ids decode alone to U+FFFD (parts of one character) and together to one."""

        def decode(self, ids, skip_special_tokens=False):
            ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
            text = super().decode([i for i in ids if i not in (11, 12)])
            return text + ("\u00e9" if 11 in ids and 12 in ids else "\ufffd" if {11, 12} & set(ids) else "")

    lens = conceptlens.attach(tiny_model("llama"), Split())
    g = torch.Generator().manual_seed(4)
    sae = TopKSAE(width=24, k=2, batch_size=64, warmup_tokens=64, seed=0)
    sae.update(torch.randn(256, 32, generator=g))
    sae.flush()
    sets = {"sae": sae.concept_set(), "dense": ConceptSet(torch.randn(5, 32, generator=g), SITE, method="custom")}
    describers = {name: ConceptDescriber(cs, top_n=6, window=(3, 2)) for name, cs in sets.items()}
    docs = [d[:3] + "hi" + d[3:] for d in DOCS]  # 'h' 'i' are ids 11 and 12
    lens.fit({SITE: describers}, docs, max_length=16, progress=False, filters=NO_NORM)
    for d in describers.values():
        got = decode_contexts(d, lens.tokenizer)
        assert got == _contexts_before(d, lens.tokenizer)
    assert any("\u00e9" in t for line in decode_contexts(describers["dense"], lens.tokenizer)
               for ctx in line["contexts"] for t in ctx["tokens"])


def test_nearest_leaves_its_scores_alone_and_skips_the_diagonal():
    from conceptlens.describe.finish import nearest

    g = torch.Generator().manual_seed(5)
    for scores in (torch.randn(9, 9, generator=g), torch.randn(9, 9, generator=g).double()):
        before = scores.clone()
        ids, values = nearest(scores, 3)
        assert torch.equal(scores, before)
        ref = scores.float().masked_fill(torch.eye(9, dtype=torch.bool), -torch.inf).topk(3, dim=1)
        assert torch.equal(ids, ref.indices) and torch.equal(values, ref.values)


def _top_by_column(scores, p, largest):
    """The plain reference: a stable sort of every row (equal values in column order), its first p."""
    order = scores.sort(dim=1, descending=largest, stable=True).indices[:, :p]
    return order, scores.gather(1, order)


def test_promoted_tokens_through_blocks_equal_a_sort_of_the_whole_vocabulary():
    from conceptlens.describe.finish import logit_tokens, row_extremes

    g = torch.Generator().manual_seed(4)
    w_u = torch.randn(3000, 16, generator=g)  # 23 whole blocks of 128 and a tail of 56 tokens
    w_u[2990] *= 50.0  # the most promoted and the most suppressed token of many directions lie in the tail
    w_u[[40, 700]] = w_u[2990].clone()  # equal logits in two blocks and the tail: listed by token id
    directions = torch.randn(40, 16, generator=g)
    got = logit_tokens(directions, w_u, 3, chunk=16)
    logits = torch.nn.functional.normalize(directions, dim=1) @ w_u.T
    for name, largest in (("promoted", True), ("suppressed", False)):
        ids, values = _top_by_column(logits, 3, largest)
        assert torch.equal(got[f"{name}_ids"], ids) and torch.equal(got[f"{name}_logit"], values)
    assert (got["promoted_ids"] == torch.tensor([40, 700, 2990])).all(1).any()
    scores = torch.randn(5, 4096, generator=g)  # no tail: whole blocks only
    for largest in (True, False):
        ids, values = row_extremes(scores, 3, largest, block=64)
        ref = _top_by_column(scores, 3, largest)
        assert torch.equal(ids, ref[0]) and torch.equal(values, ref[1])


def test_nearest_coactive_in_blocks_of_rows_equals_the_whole_matrix():
    from conceptlens.describe.finish import coactivation, nearest, nearest_coactive

    g = torch.Generator().manual_seed(6)
    z = torch.randn(50, 13, generator=g).clamp(min=0)  # (rows, n)
    for sparse, sub in ((True, (z > 0).float()), (False, z)):
        sums = {"sub_outer": sub.T @ sub, "sub_sum": sub.double().sum(0), "sub_rows": torch.tensor(50)}
        whole = coactivation(sums, sparse)
        ref = nearest(whole, 4)
        ids, values = nearest_coactive(sums, sparse, 4, chunk=5)  # 3 blocks of rows, the last one short
        assert torch.equal(ids, ref[0]) and torch.equal(values, ref[1])
        assert torch.equal(coactivation(sums, sparse, slice(5, 10)), whole[5:10])


def _state_tensors(state, prefix=""):
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out |= _state_tensors(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            out[prefix + key] = value
    return out


@pytest.mark.parametrize("signed", [False, True])
def test_sparse_batches_from_their_nonzeros_equal_the_dense_path(signed, monkeypatch):
    """An SAE set's counts, histogram, co-firing and top-N from the nonzero entries alone (the CPU
    path) equal the dense path's (the GPU path, kept as the reference), bit for bit."""
    from conceptlens.concepts.sae import TopKSAE
    from conceptlens.describe import ConceptDescriber, describer, topn
    from conceptlens.fit import TokenRows

    g = torch.Generator().manual_seed(7)
    sae = TopKSAE(width=40, k=4, batch_size=64, warmup_tokens=64, seed=0)
    sae.update(torch.randn(256, 16, generator=g))
    sae.flush()
    cs = sae.concept_set()
    cs.site = "blocks.0.resid_out"
    ids = torch.randint(0, 50, (6, 20), generator=g)
    batches = []
    for first in range(0, 6, 2):  # three batches of two documents, position 0 dropped
        doc, pos = first + torch.arange(2).repeat_interleave(19), torch.arange(1, 20).repeat(2)
        x = torch.randn(38, 16, generator=g) * 3
        x[5] = x[4]  # equal rows: equal activations, tied in the top-N
        batches.append((x, TokenRows(doc, pos, ids[first:first + 2], first)))
    states = []
    for every_row in (True, False):
        for module in (topn, describer):
            monkeypatch.setattr(module, "every_row", lambda z: every_row)
        d = ConceptDescriber(cs, top_n=5, window=(2, 1), coact_rows=16, watch_norms=True)
        if signed:  # a sparse code with negative values too (no TopK SAE gives one)
            encode = d.activations.encode_fn
            d.activations.encode_fn = lambda x: encode(x) * torch.where(torch.arange(40) % 3 == 0, -1.0, 1.0)
        for x, rows in batches:
            d.update(x, tokens=rows)
        states.append(_state_tensors(d.state_dict()))
    dense, sparse = states
    assert dense.keys() == sparse.keys() and "sums.sub_outer" in dense
    for key in dense:
        assert torch.equal(dense[key], sparse[key]), key
    assert dense["sums.sub_outer"].sum() > 0 and (dense["sums.zeros"] > 0).all()


def test_nearest_direction_in_blocks_of_rows_equals_the_whole_product():
    from conceptlens.describe.finish import nearest, nearest_direction

    g = torch.Generator().manual_seed(8)
    unit = torch.randint(-8, 9, (13, 6), generator=g).float()  # small integers: every product exact in any order
    unit[7] = unit[2]  # an equal pair, the most alike off the diagonal
    ref = nearest(unit @ unit.T, 4)
    ids, values = nearest_direction(unit, 4, chunk=5)  # 3 blocks of rows, the last one short
    assert torch.equal(values, ref[1])
    distinct = [r for r in range(13) if len(set(ref[1][r].tolist())) == 4]  # ties may list in either order
    assert len(distinct) >= 8 and torch.equal(ids[distinct], ref[0][distinct])
    assert ids[2, 0] == 7 and ids[7, 0] == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_coactivation_equals_its_definition_and_leaves_the_sums_alone(dtype):
    """Jaccard (sparse) and Pearson (dense, a constant column: 0) as written out, bit for bit."""
    from conceptlens.describe.finish import coactivation

    g = torch.Generator().manual_seed(9)
    z = torch.randn(40, 7, generator=g).clamp(min=0)
    z[:, 3] = 0.0  # never fires: union 0, std 0
    for sparse, sub in ((True, (z > 0).to(dtype)), (False, z.to(dtype))):
        sums = {"sub_outer": sub.T @ sub, "sub_sum": sub.double().sum(0), "sub_rows": torch.tensor(40)}
        before = {k: v.clone() for k, v in sums.items()}
        outer, diagonal = sums["sub_outer"].double(), sums["sub_outer"].diagonal().double()
        if sparse:
            union = diagonal[:, None] + diagonal[None, :] - outer
            ref = torch.where(union > 0, outer / union.clamp(min=1e-12), 0.0)
        else:
            mean = sums["sub_sum"] / 40.0
            cov = outer / 40.0 - mean[:, None] * mean[None, :]
            std = (diagonal / 40.0 - mean * mean).clamp(min=0).sqrt()
            denom = std[:, None] * std[None, :]
            ref = torch.where(denom > 0, cov / denom.clamp(min=1e-300), 0.0)
        assert torch.equal(coactivation(sums, sparse), ref)
        assert torch.equal(coactivation(sums, sparse, slice(2, 5)), ref[2:5])
        assert all(torch.equal(sums[k], before[k]) for k in sums)
        assert (ref[3] == 0).all() and ref[0, 0] > 0


def test_texts_decoded_once_per_pass_are_the_same_texts():
    from conceptlens.describe.finish import decoder, whole

    class Counting:
        calls = 0

        def decode(self, ids):
            Counting.calls += 1
            return "\ufffd" if ids[0] == 3 else f"t{ids[0]}"

        def convert_ids_to_tokens(self, i):
            return "<0xE2>"

    tok, known = Counting(), {}
    assert decoder(tok, [1, 2, 3], known) == decoder(tok, [1, 2, 3])
    Counting.calls = 0
    assert whole(tok, [3, 2, 5], known) == whole(Counting(), [3, 2, 5]) == {3: "<0xE2>", 2: "t2", 5: "t5"}
    assert Counting.calls == 1 + 3  # only id 5 was new to `known`; the second call decoded all three


def test_a_centred_kmeans_set_assigns_tokens_to_the_nearest_centre_as_the_set_itself():
    from conceptlens import ConceptSet
    from conceptlens.describe.activations import concept_activations

    g = torch.Generator().manual_seed(0)
    centres = torch.randn(4, 8, generator=g) + 5.0  # points near a large mean
    x = centres[torch.randint(0, 4, (200,), generator=g)] + 0.5 * torch.randn(200, 8, generator=g)
    cs = ConceptSet(centres, "s", method="kmeans", mean=x.mean(0))
    truth = torch.cdist(x, centres).argmin(1)
    for s in (cs, cs.centred()):
        a = concept_activations(s)
        assert torch.equal(a.assign_fn(a.encode(x), x), truth)
