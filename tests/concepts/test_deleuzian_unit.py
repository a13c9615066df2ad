"""Deleuzian's `unit="document"`: one sample per document, the mean of its rows."""

import pytest
import torch

from conceptlens.concepts.deleuzian import Deleuzian
from conceptlens.fit import TokenRows


def rows(n_docs=40, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 9, (n_docs,), generator=g)
    doc = torch.repeat_interleave(torch.arange(n_docs), lengths)
    x = torch.randn(len(doc), d, generator=g) + 3 * torch.randn(n_docs, d, generator=g)[doc]
    return x, doc


def tokens(doc):
    return TokenRows(doc, torch.zeros_like(doc), torch.zeros(1, 1, dtype=torch.long), 0)


@pytest.mark.parametrize("mode", ["streaming", "paper"])
def test_documents_are_fitted_as_their_mean_rows(mode):
    x, doc = rows()
    by_doc = Deleuzian(6, unit="document", mode=mode, buffer_size=32, batch_size=16, seed=3)
    by_hand = Deleuzian(6, mode=mode, buffer_size=32, batch_size=16, seed=3)
    for part in (doc < 25, doc >= 25):  # two calls, each with whole documents
        by_doc.update(x[part], tokens=tokens(doc[part]))
        means = torch.stack([x[doc == i].double().mean(0).float() for i in doc[part].unique()])
        by_hand.update(means)
    by_doc.flush(), by_hand.flush()
    assert by_doc.n_seen == by_hand.n_seen == 40
    assert torch.allclose(by_doc.centroids, by_hand.centroids, atol=1e-5)


def test_document_unit_without_tokens_is_named():
    with pytest.raises(ValueError, match="unit=\"document\" needs"):
        Deleuzian(4, unit="document").update(torch.randn(10, 3))
    with pytest.raises(ValueError, match="unit"):
        Deleuzian(4, unit="sentence")


def test_token_states_keep_the_layout_they_had_before_unit_and_document_states_name_it():
    x, doc = rows()
    dz = Deleuzian(4, buffer_size=32, batch_size=16)
    dz.update(x)
    assert "unit" not in dz.state_dict()["config"]  # as written before the field existed
    again = Deleuzian.from_state(dz.state_dict())
    assert again.config.unit == "token" and torch.equal(again.centroids, dz.centroids)
    by_doc = Deleuzian(4, unit="document", buffer_size=32, batch_size=16)
    by_doc.update(x, tokens=tokens(doc))
    assert Deleuzian.from_state(by_doc.state_dict()).config.unit == "document"
    with pytest.raises(ValueError, match="unit"):
        dz.load_state_dict(by_doc.state_dict())


def fit_beside_a_recorder(extractor):
    """Fit `extractor` at blocks.1 of a tiny Llama on 30 short documents, 8 a batch, next to a
    recorder of what fit gives: per batch, the kept rows and their document ids."""
    import conceptlens
    from tests.conftest import CharTokenizer, tiny_model

    class Rows:
        def __init__(self):
            self.x, self.doc = [], []

        def update(self, x, tokens):
            self.x.append(x.clone()), self.doc.append(tokens.doc.clone())

    lens = conceptlens.attach(tiny_model("llama"), CharTokenizer())
    docs = [f"text number {i} " + "xyz" * (i % 4) for i in range(30)]
    seen = Rows()
    lens.fit({"blocks.1.resid_out": {"rows": seen, "ex": extractor}}, docs, batch_size=8, progress=False)
    return seen.x, seen.doc


def test_fit_gives_a_document_deleuzian_the_mean_of_each_documents_kept_rows():
    dz = Deleuzian(4, unit="document", mode="paper", buffer_size=64, batch_size=32)
    xs, docs = fit_beside_a_recorder(dz)
    x, doc = torch.cat(xs), torch.cat(docs)
    by_hand = Deleuzian(4, mode="paper", buffer_size=64, batch_size=32)
    for batch in range(0, 30, 8):  # fit's batches of 8 documents
        part = (doc >= batch) & (doc < batch + 8)
        by_hand.update(torch.stack([x[doc == i].double().mean(0).float() for i in doc[part].unique()]))
    by_hand.flush()
    assert dz.n_seen == 30 and torch.allclose(dz.centroids, by_hand.centroids, atol=1e-5)


def test_fit_passes_token_rows_only_to_a_deleuzian_that_pools_documents():
    from conceptlens.concepts import registry

    assert registry.takes(Deleuzian(4, unit="document"), "tokens")
    assert not registry.takes(Deleuzian(4), "tokens")  # over tokens: no TokenRows built for it per batch
