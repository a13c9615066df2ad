"""The description pass on a tiny random Llama, checked against brute force over captured activations."""

from __future__ import annotations

import json
import math

import pytest
import torch

import conceptlens
from conceptlens import ConceptSet
from conceptlens.batching import encode_batch
from conceptlens.checkpoint import read_checkpoint
from conceptlens.describe import ConceptDescriber, Description
from conceptlens.describe.describer import fine_bins, fine_edges
from conceptlens.filters import FilterConfig
from tests.conftest import CharTokenizer, tiny_model

DOCS = [f"doc {i}: " + "abcdefgh"[i % 8] * (3 + i % 5) + " the end" for i in range(36)]
LABELS = [i % 3 for i in range(36)]
SITE = "blocks.1.resid_out"
NO_NORM = FilterConfig(max_norm_ratio=None)


class Tok(CharTokenizer):
    """CharTokenizer that also decodes and returns tensors (for generate)."""

    pad_token_id = 0

    def __call__(self, texts, truncation=False, max_length=None, return_tensors=None, **kwargs):
        out = super().__call__(texts, truncation=truncation, max_length=max_length)
        if isinstance(texts, str) and return_tensors is None:  # like HF: one text, one flat list
            return {"input_ids": out["input_ids"][0]}
        if return_tensors == "pt":
            ids = torch.tensor(out["input_ids"])
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        return out

    def decode(self, ids, skip_special_tokens=False):
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return "".join(chr(i - 3 if i - 3 >= 32 else i - 3 + 96) for i in ids)


@pytest.fixture(scope="module")
def lens():
    return conceptlens.attach(tiny_model("llama"), Tok())


def random_set(n=6, seed=0, method="custom", mean=None):
    g = torch.Generator().manual_seed(seed)
    return ConceptSet(torch.randn(n, 32, generator=g), SITE, method=method, mean=mean)


def cosines(x, cs):
    """The definition of a dense concept's activation, by hand: cos(x - m, c - m) for centroids, cos(x, c) without a mean."""
    m = torch.zeros(x.shape[1]) if cs.mean is None else cs.mean
    c = cs.directions - (0 if cs.mean is None else m)
    return torch.nn.functional.normalize(x - m, dim=1) @ torch.nn.functional.normalize(c, dim=1).T


def captured(lens, docs, max_length=16):
    """Every kept row (position > 0) of SITE with its (doc, pos), and the batch ids: the reference."""
    batch = encode_batch(lens.tokenizer, docs, max_length)
    with lens.capture(SITE) as cap:
        acts, meta = cap.forward(**batch)
    keep = meta.position > 0
    return acts[SITE][keep], meta.row[keep], meta.position[keep], batch["input_ids"]


def run(lens, sets, docs=DOCS, **kw):
    kw.setdefault("filters", NO_NORM)
    return lens.describe(sets, docs, max_length=16, progress=False, top_n=4, window=(3, 2), **kw)


@pytest.mark.parametrize("method", ["custom", "kmeans"])
def test_statistics_equal_brute_force(lens, method):
    x, doc, pos, ids = captured(lens, DOCS)
    cs = random_set(method=method, mean=x.mean(0) + 0.3 if method == "kmeans" else None)
    d = run(lens, {"a": cs}, batch_size=5)["a"]
    unit = torch.nn.functional.normalize(cs.directions - (0 if cs.mean is None else cs.mean), dim=1)
    z = cosines(x, cs)
    s = d.stats
    assert d.info["tokens"] == len(x) and d.info["documents"] == len(DOCS)
    torch.testing.assert_close(s["mean_activation"], z.mean(0))
    torch.testing.assert_close(s["max_activation"], z.max(0).values)
    assigned = torch.cdist(x, cs.directions).argmin(1) if method == "kmeans" else z.argmax(1)
    torch.testing.assert_close(s["assigned"], torch.bincount(assigned, minlength=6).float() / len(x))
    torch.testing.assert_close(s["frequency"], (z > 0).float().mean(0))  # the histogram's mass right of 0
    assert torch.equal(s["hist_counts"].sum(1), torch.full((6,), len(x)))  # no exact zeros here
    for c in range(6):
        order = torch.sort(z[:, c], descending=True, stable=True).indices[:4]
        torch.testing.assert_close(s["top_values"][c], z[order, c])
        assert s["top_doc"][c].tolist() == doc[order].tolist() and s["top_pos"][c].tolist() == pos[order].tolist()
        ctx = d.contexts[c]["contexts"][0]
        text = DOCS[int(doc[order[0]])]
        p = int(pos[order[0]])
        assert "".join(ctx["tokens"]) == text[max(0, p - 3):min(p + 3, 16)]
        assert ctx["tokens"][ctx["center"]] == text[p] and ctx["acts"][ctx["center"]] == pytest.approx(ctx["value"], rel=1e-4)
    cos = unit @ unit.T
    cos.fill_diagonal_(-2)
    assert s["nearest_direction"][:, 0].tolist() == cos.argmax(1).tolist()
    corr = torch.corrcoef(z.T.double())
    corr.fill_diagonal_(-2)
    assert s["nearest_coact"][:, 0].tolist() == corr.argmax(1).tolist()  # every row used: 512 >= batch rows
    assert d.info["coact_kind"] == "pearson" and d.info["has_unembedding"]


def test_sae_set_fires_on_positive_latents_and_jaccard_neighbours(lens):
    from conceptlens.concepts.sae import TopKSAE

    sae = TopKSAE(width=16, k=3, batch_size=32, warmup_tokens=64, seed=0)
    cs = lens.fit({SITE: sae}, DOCS * 3, max_length=16, progress=False, filters=NO_NORM).concepts[SITE]
    d = run(lens, {"sae": cs}, batch_size=36, coact_rows=4096)["sae"]  # every row
    x, *_ = captured(lens, DOCS)
    z = sae.encode(x)
    fired = (z > 0).double()
    torch.testing.assert_close(d.stats["frequency"], fired.mean(0).float())
    nonzero = (z != 0).sum(0)
    assert torch.equal(d.stats["hist_counts"].sum(1), nonzero)
    both = fired.T @ fired
    union = fired.sum(0)[:, None] + fired.sum(0)[None] - both
    jac = torch.where(union > 0, both / union.clamp(min=1), 0.0)
    jac.fill_diagonal_(-1)
    torch.testing.assert_close(d.stats["nearest_coact_score"][:, 0], jac.max(1).values.float())
    assert d.info["coact_kind"] == "jaccard" and d.info["activation"] == "topk encoder"
    top = d.stats["top_values"]
    assert torch.all((top > 0) | ((top == -torch.inf) & (d.stats["top_doc"] == -1)))  # zero is no context
    for c in range(16):
        order = torch.sort(z[:, c], descending=True, stable=True).indices[:4]
        fired_top = z[order, c][z[order, c] > 0]
        torch.testing.assert_close(top[c, : len(fired_top)], fired_top)
        assert len(d.contexts[c]["contexts"]) == len(fired_top)


def test_histogram_bins_and_display_edges_hold_every_value():
    from conceptlens.describe.finish import display_histogram, map_xy
    from conceptlens.describe.topn import order_key

    z = torch.tensor([-70000.0, -3.0, -1.3, -1e-9, -0.0, 0.0, 1e-9, 2 ** -16, 0.3, 1.0, 1.24, 1.25, 5.0, 70000.0])
    bins = fine_bins(order_key(z[:, None]))[:, 0]
    edges = fine_edges()
    assert edges.shape == (257,) and torch.all(edges[1:] > edges[:-1])
    for value, b in zip(z.tolist(), bins.tolist()):
        if value == 0:
            assert b == 128  # counted apart and subtracted
        elif 2 ** -16 <= abs(value) < 2 ** 16:
            inside = edges[b] <= value < edges[b + 1] if value > 0 else edges[b] < value <= edges[b + 1]
            assert inside, (value, b)  # negative bins mirror the positive ones: (lower, upper]
    assert bins[0] == 0 and bins[-1] == 255 and bins[3] == 127 and bins[6] == 128  # end bins
    assert bins[10] == bins[9] and bins[11] == bins[9] + 1  # 1.24 and 1.0 share a bin; 1.25 starts the next
    hist = torch.bincount(bins, minlength=256)[None]
    e, c = display_histogram(hist, torch.tensor([2]), 8)
    assert c.sum() == len(z) - 2 and torch.all(e[0, 1:] >= e[0, :-1])
    assert e[0, 0] == -(2.0 ** 16) and e[0, -1] == 2.0 ** 16
    g = torch.Generator().manual_seed(0)
    for dirs in (torch.randn(20, 5, generator=g), torch.randn(5, 20, generator=g)):  # n > d and n < d
        unit = torch.nn.functional.normalize(dirs.double(), dim=1)
        _, _, vh = torch.linalg.svd(unit - unit.mean(0))
        ref = (unit - unit.mean(0)) @ vh[:2].T
        torch.testing.assert_close(map_xy(dirs).double().abs(), ref.abs(), rtol=1e-4, atol=1e-5)  # up to sign


def test_a_set_named_by_another_name_of_its_site_is_described_as_itself(lens):
    """`blocks.-1.resid_out` is blocks.1 of the 2-block model: the set keeps its mean (centred cosines),
    not only its directions, when describe renames its site."""
    mean = torch.randn(32, generator=torch.Generator().manual_seed(7))
    canonical = random_set(seed=4, method="kmeans", mean=mean)
    alias = ConceptSet(canonical.directions, "blocks.-1.resid_out", method="kmeans", mean=mean)
    one, other = run(lens, {"k": canonical})["k"], run(lens, {"k": alias})["k"]
    for key in ("top_values", "top_doc", "top_pos", "hist_counts", "frequency"):
        assert torch.equal(one.stats[key], other.stats[key]), key


def test_batching_does_not_change_the_description(lens):
    sets = {"a": random_set(seed=1), "b": random_set(n=3, seed=2)}
    one, other = run(lens, sets, batch_size=4), run(lens, sets, batch_size=11)
    for name in sets:
        for key in ("top_values", "top_doc", "top_pos", "hist_counts", "hist_edges", "frequency"):
            assert torch.equal(one[name].stats[key], other[name].stats[key]), key
        assert one[name].contexts == other[name].contexts


def test_resume_and_merge_equal_one_pass(lens, tmp_path):
    cs = {"a": random_set(seed=3)}
    whole = run(lens, cs, batch_size=4)["a"]
    run(lens, cs, batch_size=4, max_tokens=150, out=str(tmp_path))  # an interrupted pass ...
    done = read_checkpoint(tmp_path / "checkpoint.pt")["progress"]["documents"]
    calls = []
    handle = lens.model.model.embed_tokens.register_forward_hook(lambda *a: calls.append(1))
    try:
        resumed = run(lens, cs, batch_size=4, out=str(tmp_path))["a"]  # ... continued from its checkpoint
    finally:
        handle.remove()
    assert 0 < done < len(DOCS) and len(calls) == math.ceil((len(DOCS) - done) / 4)
    halves = []
    for first, docs in ((0, DOCS[:20]), (20, DOCS[20:])):
        plan = {SITE: {"a": ConceptDescriber(cs["a"], top_n=4, window=(3, 2), first_document=first)}}
        lens.fit(plan, docs, batch_size=4, max_length=16, progress=False, filters=NO_NORM)
        halves.append(plan[SITE]["a"])
    merged = halves[0]
    merged.merge(halves[1].state_dict())
    merged_top = merged.top
    for other in (resumed,):
        assert torch.equal(other.stats["top_values"], whole.stats["top_values"])
        assert torch.equal(other.stats["hist_counts"], whole.stats["hist_counts"])
    assert torch.equal(merged_top.values, whole.stats["top_values"])
    assert merged_top.doc.tolist() == whole.stats["top_doc"].tolist()
    assert torch.equal(merged.sums["hist"].sum(1), whole.stats["hist_counts"].sum(1))


def test_a_pass_resumed_with_a_smaller_budget_describes_that_budget(lens, tmp_path):
    """A checkpoint of a longer pass (interrupted past the budget now given) is dropped, not resumed: the
    description is a pass of the budget given, as the command line prints it."""
    cs = {"a": random_set(seed=3)}
    fresh = run(lens, cs, batch_size=4, max_tokens=60)["a"]
    longer = run(lens, cs, batch_size=4, max_tokens=150, out=str(tmp_path))["a"]
    assert longer.info["tokens"] > fresh.info["tokens"] >= 60
    again = run(lens, cs, batch_size=4, max_tokens=60, out=str(tmp_path))["a"]
    assert again.info["tokens"] == fresh.info["tokens"]
    assert torch.equal(again.stats["top_values"], fresh.stats["top_values"])


def test_a_pass_over_sets_fitted_again_starts_afresh_and_the_atlas_refuses_a_stale_description(lens, tmp_path):
    """The checkpoint of a pass over other sets of the same shapes (the fit ran on) is not resumed
    into the new sets' description; a description of an earlier fit of its set is refused by the atlas."""
    from conceptlens.report.atlas import Atlas

    old, new = {"a": random_set(seed=3)}, {"a": random_set(seed=4)}
    fresh = run(lens, new, batch_size=4, max_tokens=60)["a"]
    run(lens, old, batch_size=4, max_tokens=60, out=str(tmp_path / "describe"))
    again = run(lens, new, batch_size=4, max_tokens=60, out=str(tmp_path / "describe"))["a"]
    assert torch.equal(again.stats["top_values"], fresh.stats["top_values"])
    assert again.info["set_sha256"] == new["a"].digest() != old["a"].digest()
    new["a"].save(tmp_path / "concepts" / "a")
    assert Atlas.load(tmp_path).extractor("a").n == 6
    old["a"].save(tmp_path / "concepts" / "a")  # fitted again since its description
    with pytest.raises(ValueError, match="describe/a describes an earlier fit of .*concepts/a .*run `conceptlens "
                                         "describe"):
        Atlas.load(tmp_path)


def test_labels_give_per_class_probes_and_base_rates(lens, tmp_path):
    d = run(lens, {"a": random_set()}, labels=LABELS, label_names=["x", "y", "z"], skip_documents=6,
            out=str(tmp_path))["a"]
    assert d.stats["probe_loss"].shape == (6, 3) and torch.isfinite(d.stats["probe_loss"]).all()
    rate = sum(1 for i in range(6, 36) if (i - 6) % 2 == 1 and LABELS[i] == 0) / 15
    assert d.info["base_rate_entropy"]["x"] == pytest.approx(-(rate * math.log(rate) + (1 - rate) * math.log(1 - rate)))
    assert d.info["first_document"] == 6 and d.stats["top_doc"].min() >= 6
    loaded = Description.load(tmp_path / "a")
    assert loaded.info == json.loads(json.dumps(d.info)) and loaded.contexts == d.contexts
    assert loaded.tokens == d.tokens and set(loaded.stats) == set(d.stats)
    info = json.loads((tmp_path / "a" / "description.json").read_text())
    assert info["format"] == "conceptlens.Description" and info["labels"] == ["x", "y", "z"]


def test_the_unembedding_is_read_only_at_sites_in_the_residual_basis():
    from conceptlens.describe.run import unembedding

    gpt2 = conceptlens.attach(tiny_model("gpt2"), Tok())  # 4 heads of 8: attn.z is 32 wide, as the residual
    assert torch.equal(unembedding(gpt2, "blocks.0.resid_out", 32), gpt2.model.get_output_embeddings().weight)
    for site in ("blocks.0.attn.z", "blocks.0.attn.q", "blocks.0.attn.v"):
        assert unembedding(gpt2, site, 32) is None, site


def test_promoted_tokens_are_the_unembedding_extremes(lens):
    cs = random_set()
    d = run(lens, {"a": cs}, options=conceptlens.describe.FinishOptions(n_tokens=5))["a"]
    logits = torch.nn.functional.normalize(cs.directions, dim=1) @ lens.model.get_output_embeddings().weight.T
    assert d.stats["promoted_ids"].tolist() == logits.topk(5).indices.tolist()
    assert d.stats["suppressed_ids"].tolist() == (-logits).topk(5).indices.tolist()
    assert d.tokens["promoted"][0][0] == lens.tokenizer.decode([int(d.stats["promoted_ids"][0, 0])])


def test_bad_sets_fail_before_any_forward(lens):
    with pytest.raises(ValueError, match="width 8 but blocks.1.resid_out has width 32"):
        run(lens, {"a": ConceptSet(torch.randn(3, 8), SITE)})
    with pytest.raises(KeyError):
        run(lens, {"a": ConceptSet(torch.randn(3, 32), "blocks.9.resid_out")})
    with pytest.raises(ValueError, match="not among the label names"):
        run(lens, {"a": random_set()}, labels=["q"] * 36, label_names=["x"])


def test_describer_refuses_states_and_shards_it_cannot_take():
    cs = random_set()
    a, b = ConceptDescriber(cs, top_n=4), ConceptDescriber(cs, top_n=3)
    with pytest.raises(ValueError, match="different config"):
        a.load_state_dict(b.state_dict())
    with pytest.raises(ValueError, match="cannot merge a description of 6 concepts"):
        a.merge(b)
    with pytest.raises(ValueError, match="with labels keep per-document sums"):
        ConceptDescriber(cs, n_documents=5).merge(ConceptDescriber(cs, n_documents=5))
    assert a.stats() == (0, 0)


def test_a_pass_marker_that_does_not_read_drops_the_checkpoint_it_cannot_vouch_for(tmp_path):
    from conceptlens.describe.run import _forget_other_pass
    from conceptlens.fit import CHECKPOINT

    source = {"skip_documents": 3, "data": "bbc-news"}
    for damaged in ("", '{"skip_documents": 3,', "\udcff"):
        (tmp_path / "source.json").write_text(damaged, errors="surrogateescape")
        (tmp_path / CHECKPOINT).write_bytes(b"a pass over unknown documents")
        _forget_other_pass(tmp_path, source, None)
        assert not (tmp_path / CHECKPOINT).exists()
        assert json.loads((tmp_path / "source.json").read_text()) == source
    (tmp_path / CHECKPOINT).write_bytes(b"this pass")
    _forget_other_pass(tmp_path, source, None)  # the same pass: its checkpoint stays
    assert (tmp_path / CHECKPOINT).read_bytes() == b"this pass"


def test_a_pass_over_another_split_or_order_of_a_bundled_set_starts_afresh(tmp_path):
    """`describe RUN --describe-data bbc-news:train` after an interrupted pass over its test split: the
    checkpoint of the other documents is dropped, not resumed on these."""
    from conceptlens import data
    from conceptlens.commands.sources import source
    from conceptlens.describe.run import _forget_other_pass, _source_id
    from conceptlens.fit import CHECKPOINT

    passes = [source("bbc-news:test", 0), source("bbc-news:train", 0), source("bbc-news:train", 1),
              data.load("bbc-news", "train")]
    assert len({_source_id(p) for p in passes}) == 4 and _source_id(source("bbc-news:test", 0)) == _source_id(passes[0])
    for was, now in zip(passes, passes[1:]):
        _forget_other_pass(tmp_path, {"skip_documents": 0, "data": _source_id(was)}, None)
        (tmp_path / CHECKPOINT).write_bytes(b"an interrupted pass")
        _forget_other_pass(tmp_path, {"skip_documents": 0, "data": _source_id(now)}, None)
        assert not (tmp_path / CHECKPOINT).exists()


def test_a_save_killed_half_way_leaves_no_description_rather_than_a_mixed_one(lens, tmp_path, monkeypatch):
    from conceptlens.describe import description as module

    first = run(lens, {"a": random_set(seed=5)}, batch_size=4, max_tokens=60)["a"]
    second = run(lens, {"a": random_set(seed=6)}, batch_size=4, max_tokens=60)["a"]
    first.save(tmp_path / "a")
    real = module.atomic_write

    def dies_at_contexts(path, write):
        if str(path).endswith("contexts.jsonl"):
            raise KeyboardInterrupt
        real(path, write)

    monkeypatch.setattr(module, "atomic_write", dies_at_contexts)
    with pytest.raises(KeyboardInterrupt):
        second.save(tmp_path / "a")  # new statistics written, then killed
    with pytest.raises(FileNotFoundError, match="description.json not found"):
        Description.load(tmp_path / "a")
    monkeypatch.setattr(module, "atomic_write", real)
    second.save(tmp_path / "a")
    assert torch.equal(Description.load(tmp_path / "a").stats["top_values"], second.stats["top_values"])


def test_steering_samples_asked_of_an_encoder_are_said_to_be_left_out():
    """An encoder cannot continue a prompt: `--steer` on MiniLM gave a description without samples, unsaid."""
    from conceptlens.describe import SteeringRequest

    bert = conceptlens.attach(tiny_model("bert"), Tok())
    assert not bert.model.can_generate()
    with pytest.warns(UserWarning, match=r"^no steering samples: BertForMaskedLM does not generate text \(an "
                                         r"encoder\), so steering a:1, a:4 is left out$"):
        d = run(bert, {"a": random_set()}, steering=SteeringRequest(["a:1", "a:4"]))["a"]
    assert d.info.get("steering") == []
