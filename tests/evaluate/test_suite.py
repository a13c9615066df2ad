"""The suite's configuration checks and the quality part's lines."""

import math

import pytest
import torch

from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.evaluate import suite, table
from conceptlens.evaluate.activations import Probed


def test_config_names_the_bad_value_and_the_choices():
    with pytest.raises(ValueError, match=r"unknown suites \['axbench'\]; choose from reconstruction, probing"):
        suite.SuiteConfig(suites=("probing", "axbench"))
    with pytest.raises(ValueError, match="unknown tasks"):
        suite.SuiteConfig(tasks=("imdb",))
    with pytest.raises(ValueError, match="max_docs must be a positive integer; got 0"):
        suite.SuiteConfig(max_docs=0)
    with pytest.raises(ValueError, match=r"ks must be positive integers; got \[0, 5\]"):
        suite.SuiteConfig(ks=(0, 5))


def test_quality_part_carries_the_quality_table_rows():
    g = torch.Generator().manual_seed(0)
    y = torch.arange(90) % 3
    x = torch.randn(90, 8, generator=g)
    z = torch.randn(90, 5, generator=g)
    z[:, 2] += 3.0 * (y == 1)
    probed = Probed(x, {"set": z}, y, torch.arange(90))
    cs = ConceptSet(torch.randn(5, 8, generator=g))
    lines = suite._quality("toy", probed, probed, {"set": cs}, ["a", "b", "c"], suite.SuiteConfig())
    rows = table.metric_rows(cs.directions, table.Features(x, z, y), table.Features(x, z, y), ["a", "b", "c"], None, 16)
    assert [ln.metric for ln in lines] == [f"toy {r.metric.strip()}" for r in rows]
    assert [ln.value.value for ln in lines] == pytest.approx([r.value for r in rows], nan_ok=True)
    assert all(math.isnan(ln.value.low) for ln in lines)
    assert lines[0].baselines[0][0] == "base-rate entropy"


def test_probe_train_documents_pass_over_those_a_fit_read():
    from conceptlens import data
    from conceptlens.commands.sources import source

    fitted, full = 320, data.load("bbc-news", "train")
    fit_texts = source("bbc-news:train", 7).texts[:fitted]  # the fit's shuffle with seed 7
    order = torch.randperm(len(full), generator=torch.Generator().manual_seed(7)).tolist()
    assert [full.texts[i] for i in order[:fitted]] == fit_texts  # (ids, since the set repeats some texts)
    read = set(fit_texts)  # bbc-news repeats some articles: another copy of a fitted text is passed over too
    _, same = suite._docs("bbc-news", "train", 240, 7, ("bbc-news", 7, fitted))  # probes drawn with the fit's seed
    copies = [i for i in order[fitted:fitted + 240] if full.texts[i] in read]
    assert len(copies) == 1  # (id 206: a copy of a fitted article, with an id of its own)
    assert same == [i for i in order[fitted:] if i not in copies][:240]
    _, other = suite._docs("bbc-news", "train", 240, 0, ("bbc-news", 7, fitted))  # another seed: its order, minus
    assert len(set(other)) == 240 and not set(order[:fitted]) & set(other)
    assert not read & {full.texts[i] for i in other}
    ahead = torch.randperm(len(full), generator=torch.Generator().manual_seed(0)).tolist()
    assert other == [i for i in ahead if full.texts[i] not in read][:240]
    assert other != [i for i in ahead if i not in set(order[:fitted])][:240]  # ids alone would keep 6 copies
    _, unshuffled = suite._docs("bbc-news", "train", 10, 0, ("bbc-news", None, 1000))  # a fit in file order
    assert min(unshuffled) >= 1000
    assert suite._docs("bbc-news", "train", 10, 0, ("movie-polarity", 7, fitted))[1] == ahead[:10]  # another set's fit
    with pytest.raises(ValueError, match="all read by the fit"):
        suite._docs("bbc-news", "train", 10, 7, ("bbc-news", 7, len(full)))
    test = data.load("bbc-news", "test")  # held-out text (the reconstruction part's): no copy of a fitted article
    test_order = torch.randperm(len(test), generator=torch.Generator().manual_seed(3)).tolist()
    repeats = [i for i in test_order[:32] if test.texts[i] in read]
    assert repeats  # the test split repeats train articles this fit read
    _, held = suite._docs("bbc-news", "test", 32, 3, ("bbc-news", 7, fitted))
    assert held == [i for i in test_order if test.texts[i] not in read][:32]


def test_a_fit_over_all_or_test_articles_leaves_them_out_of_the_probes_test_documents():
    """`fit --data bbc-news:all` (or :test) read test articles: the probes are scored on none of them."""
    from conceptlens.commands.sources import source

    for spec in ("bbc-news:all", "bbc-news:test"):
        read = set(source(spec, 5).texts[:200])
        train, test, _ = suite.held_out("bbc-news", 200, 200, 0, (spec, 5, 200))
        scored = {full.texts[i] for full, i in train + test}
        assert len(train) == len(test) == 200 and not read & scored
        assert read & {full.texts[i] for full, i in suite.held_out("bbc-news", 200, 200, 0)[1]}  # else: some of them


def test_the_reconstruction_part_scores_no_test_article_the_fit_read(monkeypatch):
    from conceptlens import data
    from conceptlens.commands.sources import source
    from conceptlens.evaluate import reconstruction

    scored: list[str] = []
    monkeypatch.setattr(suite, "encode_batch", lambda tok, texts, n: {"input_ids": texts, "texts": texts})
    monkeypatch.setattr(suite.act, "collect", lambda lens, site, readers, batches, add: [add(torch.ones(1, 4), None)
                                                                                       for _ in batches])
    monkeypatch.setattr(reconstruction, "reconstruction_lines",
                        lambda lens, site, decoders, batches, mean, seed: scored.extend(t for b in batches
                                                                                        for t in b["texts"]) or [])
    fit = source("bbc-news:train", 3).texts[:640]
    suite._reconstruction(None, None, "s", {}, suite.SuiteConfig(recon_docs=32, seed=3, fit_read=("bbc-news", 3, 640)))
    assert len(scored) == 32 and not set(scored) & set(fit)
    assert set(scored) <= set(data.load("bbc-news", "test").texts)


def test_top_up_scores_on_train_articles_neither_the_fit_nor_the_probes_read(monkeypatch):
    from conceptlens import data
    from conceptlens.evaluate import activations as act

    monkeypatch.setattr(act, "task_batches", lambda tok, texts, labels, **kw: [(texts, labels)])
    monkeypatch.setattr(act, "collect", lambda lens, site, readers, batches: next(iter(batches)))
    train, test = data.load("bbc-news", "train"), data.load("bbc-news", "test")
    config = suite.SuiteConfig(seed=7, fit_read=("bbc-news", 7, 320), progress=False)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(7)).tolist()
    test_order = torch.randperm(len(test), generator=torch.Generator().manual_seed(7)).tolist()
    label = lambda full, i: full.label_names.index(full.labels[i])

    got_train, got_test, names = suite.capture_task(None, None, "s", {}, "bbc-news", config, docs=(240, 1000),
                                                    top_up=True)
    fitted = {train.texts[i] for i in order[:320]}
    probes = [i for i in order[320:] if train.texts[i] not in fitted]  # the probes' 240, then the top-up's
    assert got_train == ([train.texts[i] for i in probes[:240]], [label(train, i) for i in probes[:240]])
    excluded = fitted | {train.texts[i] for i in probes[:240]}  # the fit's 320 and the probes' 240
    seen = set(excluded)
    scored = []
    for full, i in [(test, i) for i in test_order] + [(train, i) for i in probes[240:]]:
        if full.texts[i] not in seen and len(scored) < 1000:
            seen.add(full.texts[i])
            scored.append((full, i))
    assert 900 < len(scored) == 1000 and len(scored) < len(test) + len(order) - 560  # some repeats passed over
    assert got_test == ([full.texts[i] for full, i in scored], [label(full, i) for full, i in scored])
    assert not set(got_test[0]) & excluded and len(set(got_test[0])) == 1000
    from_test = sum(full is test for full, _ in scored)
    assert from_test < len(test)  # bbc-news's test split repeats train articles
    assert suite.held_out("bbc-news", 240, 1000, 7, ("bbc-news", 7, 320), top_up=True)[2] == from_test
    left = suite.held_out("bbc-news", 240, 10_000, 7, ("bbc-news", 7, 320), top_up=True)[1]  # all that is left
    assert len(left) == len(({train.texts[i] for i in probes[240:]} | {test.texts[i] for i in test_order}) - excluded)
    assert len(suite.held_out("bbc-news", 240, 100, 7, ("bbc-news", 7, 320), top_up=True)[1]) == 100

    plain = suite.capture_task(None, None, "s", {}, "bbc-news", config, docs=(240, 1000))[1]  # the split alone
    assert plain == ([full.texts[i] for full, i in scored[:from_test]], [label(test, i) for _, i in scored[:from_test]])


def test_a_fit_that_read_every_test_article_is_one_line_not_an_empty_probe():
    from conceptlens import data

    every = len(data.load("bbc-news", "test"))
    with pytest.raises(ValueError, match="^bbc-news: every test document was read by the fit or the probes"):
        suite.held_out("bbc-news", 50, 50, 0, ("bbc-news:test", 0, every))
