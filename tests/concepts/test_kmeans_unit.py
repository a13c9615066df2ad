"""k-means' `unit="document"`: one row per document, the mean of its rows."""

import pytest
import torch

from conceptlens.concepts.kmeans import StreamingKMeans
from conceptlens.concepts.kmeans_math import group_means
from tests.concepts.test_deleuzian_unit import fit_beside_a_recorder, tokens


def rows(n_docs=40, d=8, seed=0):
    """Documents of 2-8 rows (even counts) whose exact mean is an integer centre: rows are the centre
    plus and minus dyadic offsets, so every sum is exact in float32 and float64."""
    g = torch.Generator().manual_seed(seed)
    halves = torch.randint(1, 5, (n_docs,), generator=g)
    centres = torch.randint(-8, 9, (n_docs, d), generator=g).float()
    x, doc = [], []
    for i, h in enumerate(halves.tolist()):
        e = torch.randint(-16, 17, (h, d), generator=g).float() / 4
        x.append(torch.cat([centres[i] + e, centres[i] - e]))
        doc.append(torch.full((2 * h,), i))
    return torch.cat(x), torch.cat(doc), centres


def test_documents_are_fitted_as_their_mean_rows():
    x, doc, centres = rows()
    by_doc = StreamingKMeans(5, unit="document", init_size=30, batch_size=4, seed=3)
    by_hand = StreamingKMeans(5, init_size=30, batch_size=4, seed=3)
    for part in (doc < 25, doc >= 25):  # two calls, each with whole documents
        by_doc.update(x[part], tokens=tokens(doc[part]))
        by_hand.update(centres[doc[part].unique()])
    by_doc.flush(), by_hand.flush()
    assert by_doc.n_seen == by_hand.n_seen == 40
    assert torch.equal(by_doc.centres, by_hand.centres) and torch.equal(by_doc.mass, by_hand.mass)
    token_km = StreamingKMeans(5, init_size=30, batch_size=4, seed=3)  # the default: every row
    token_km.update(x)
    assert token_km.n_seen == len(x) > 40


def test_document_unit_errors_are_named():
    with pytest.raises(ValueError, match="unit=\"document\" needs"):
        StreamingKMeans(4, unit="document").update(torch.randn(10, 3))
    with pytest.raises(ValueError, match="unweighted; pass no weight"):
        StreamingKMeans(4, unit="document").update(torch.randn(4, 3), torch.ones(4), tokens=tokens(torch.arange(4)))
    with pytest.raises(ValueError, match="'sentence'"):
        StreamingKMeans(4, unit="sentence")


def test_token_states_keep_their_layout_and_document_states_and_sets_name_the_unit():
    x, doc, _ = rows()
    km = StreamingKMeans(4, init_size=16)
    km.update(x)
    assert "unit" not in km.state_dict()["config"] and "unit" not in km.concept_set().config
    again = StreamingKMeans.from_state(km.state_dict())
    assert again.config.unit == "token" and torch.equal(again.centres, km.centres)
    by_doc = StreamingKMeans(4, unit="document", init_size=16)
    by_doc.update(x, tokens=tokens(doc))
    assert StreamingKMeans.from_state(by_doc.state_dict()).config.unit == "document"
    assert by_doc.concept_set().config["unit"] == "document"
    with pytest.raises(ValueError, match="unit"):
        km.load_state_dict(by_doc.state_dict())


def test_fit_gives_a_document_kmeans_the_mean_of_each_batchs_documents():
    km = StreamingKMeans(4, unit="document", init_size=12, batch_size=8)
    xs, docs = fit_beside_a_recorder(km)
    by_hand = StreamingKMeans(4, init_size=12, batch_size=8)
    for x, doc in zip(xs, docs):  # fit's batches, each row of the batch's documents
        by_hand.update(group_means(x, doc))
    by_hand.flush()
    assert km.n_seen == by_hand.n_seen == 30
    assert torch.equal(km.centres, by_hand.centres)


def test_fit_passes_token_rows_only_to_a_kmeans_that_pools_documents():
    from conceptlens.concepts import registry

    from conceptlens.concepts.sharded import ShardedKMeans

    assert registry.takes(StreamingKMeans(4, unit="document"), "tokens")
    assert not registry.takes(StreamingKMeans(4), "tokens")
    assert registry.takes(ShardedKMeans(4, unit="document"), "tokens")  # a subclass: read from its signature
    assert not registry.takes(ShardedKMeans(4), "tokens")  # no per-batch token ids gathered for it


def test_a_document_kmeans_merges_anothers_buffered_document_means_and_refuses_a_token_one():
    x, doc, centres = rows()
    whole = StreamingKMeans(5, unit="document", init_size=30, batch_size=5, seed=3)
    first = StreamingKMeans(5, unit="document", init_size=30, batch_size=5, seed=3)
    buffered = StreamingKMeans(5, unit="document", init_size=30, batch_size=5, seed=3)
    whole.update(x, tokens=tokens(doc))  # batches of 5 documents cut 30 + 10 as they cut 40
    first.update(x[doc < 30], tokens=tokens(doc[doc < 30]))  # initialised on its 30 documents
    buffered.update(x[doc >= 30], tokens=tokens(doc[doc >= 30]))  # 10 documents: still buffering
    first.merge(buffered)  # its buffered rows are document means already, taken as they are
    assert first.n_seen == whole.n_seen == 40
    assert torch.equal(first.centres, whole.centres)
    with pytest.raises(ValueError, match="unit must match"):
        first.merge(StreamingKMeans(5, init_size=30))


def test_a_document_sets_activation_says_so_where_the_atlas_shows_it():
    from conceptlens.describe.activations import concept_activations

    x, doc, _ = rows()
    by_doc, by_token = StreamingKMeans(4, unit="document", init_size=16), StreamingKMeans(4, init_size=16)
    by_doc.update(x, tokens=tokens(doc)), by_token.update(x)
    assert concept_activations(by_doc.concept_set()).kind.endswith("nearest centre; fitted on document means")
    assert "document" not in concept_activations(by_token.concept_set()).kind
