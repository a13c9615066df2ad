"""Probe columns without holding them: token-level columns read batch by batch give the probes of the
whole per-token matrices (the same latents, the same scores), and readers that read alike are shared."""

import pytest
import torch
import torch.nn.functional as F

import conceptlens
from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.evaluate.activations import Derived, Probed, TokenColumns, collect, pool_documents
from conceptlens.evaluate.probing import (binary_tasks, concept_probe_lines, fit_sparse_probe, probing_lines, sides,
                                          sparse_probe_accuracies)
from conceptlens.evaluate.readings import (READINGS, choose, column, control_reader, probe_readers,
                                          random_directions)
from tests.conftest import tiny_model

SITE = "blocks.0.resid_out"


def _sae_set(n: int, d: int, k: int, seed: int, b_dec: torch.Tensor | None = None) -> ConceptSet:
    g = torch.Generator().manual_seed(seed)
    enc = {"W_enc": torch.randn(d, n, generator=g), "b_enc": torch.randn(n, generator=g),
           "b_dec": torch.randn(d, generator=g) if b_dec is None else b_dec}
    return ConceptSet(torch.randn(n, d, generator=g), SITE, method="topk", encoder=enc, config={"width": n, "k": k})


def _sets() -> dict[str, ConceptSet]:
    g = torch.Generator().manual_seed(9)
    kmeans = ConceptSet(torch.randn(6, 32, generator=g), SITE, method="kmeans", mean=torch.randn(32, generator=g))
    return {"a": _sae_set(64, 32, 4, 1), "b": _sae_set(64, 32, 4, 2), "km": kmeans}


def _tagged_batches(seed: int, n_batches: int = 6) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """Random token batches, about 70% of tokens tagged with one of 3 classes (-1: untagged)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        ids = torch.randint(3, 99, (4, 12), generator=g)
        tags = torch.randint(3, (4, 12), generator=g)
        tags[torch.rand(4, 12, generator=g) > 0.7] = -1
        out.append(({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, tags))
    return out


def _whole(p: Probed) -> Probed:
    """`p` with every token column as the whole `(N, n)` matrix (what collect kept per token before)."""
    return p._replace(z={name: p.z[name] for name in p.z})


def test_token_columns_read_in_batches_give_the_probes_of_the_whole_matrices():
    lens = conceptlens.attach(tiny_model("llama"))
    sets = _sets()
    readers = probe_readers({"a": sets["a"], "km": sets["km"]}, READINGS, draws=2)
    calls = []
    counted = {name: (lambda x, f=f: calls.append(len(x)) or f(x)) for name, f in readers.items()}
    train, test = (collect(lens, SITE, counted, _tagged_batches(seed)) for seed in (0, 1))
    assert isinstance(train.z, TokenColumns) and column("a", "code", 1) in train.z and "b" not in train.z
    assert not calls  # token rows kept, no column read yet (not even to look a name up)
    names = ["toy", "x", "y"]
    lines = probing_lines("toy", train, test, names, reading="code", ks=(1, 5))
    assert 0 < max(calls) <= 4 * 11  # every read is one batch of tokens (position 0 left out)
    whole_train, whole_test = _whole(train), _whole(test)
    assert lines == probing_lines("toy", whole_train, whole_test, names, reading="code", ks=(1, 5)) and len(lines) == 4
    assert concept_probe_lines("toy", train, test, names, top=3) == concept_probe_lines("toy", whole_train,
                                                                                      whole_test, names, top=3)

    # the chosen latents and scores are those of SAEBench's probe on the whole matrix (`fit_sparse_probe`)
    tasks = binary_tasks(train.y, test.y, names)
    key = column("a", "code", 1)
    chosen = choose(train.z, test.z, key, sides(tasks), (1, 5))
    assert chosen.train.shape == (len(train.y), len(chosen.keep)) and len(chosen.keep) <= len(tasks) * 6
    per_doc = sparse_probe_accuracies(chosen, tasks, test.doc, int(test.doc.max()) + 1)
    for j, t in enumerate(tasks):
        for i, k in enumerate((1, 5)):
            probe = fit_sparse_probe(whole_train.z[key][t.train], t.y_train, k)
            assert chosen.features[j][i].tolist() == probe.features.tolist()
            correct = int((probe.predict(whole_test.z[key][t.test]) == t.y_test).sum())
            assert per_doc[i][:, 2 * j].sum().item() == correct


def test_controls_that_read_alike_are_one_reader_read_once():
    sets = _sets()
    sets["c"] = _sae_set(64, 32, 4, 3, b_dec=sets["a"].encoder["b_dec"])  # a's width, k and b_dec
    sets["wide"] = _sae_set(96, 32, 4, 4)
    readers = probe_readers(sets, READINGS, draws=2)
    for r in range(2):
        act = {name: readers[column(name, "activation", r)] for name in sets}
        code = {name: readers[column(name, "code", r)] for name in sets}
        assert act["a"] is act["b"] is act["c"] and act["wide"] is not act["a"]  # projections on one width's draws
        assert code["a"] is code["c"] and code["b"] is not code["a"]  # random TopK encoders with the set's b_dec
        assert act["km"] is not act["a"] and code["km"] is not act["km"]
    assert all(readers[column(name, "code")] is readers[column(name)] for name in ("a", "b", "c", "wide"))
    separate = {key: f for name, cs in sets.items() for key, f in probe_readers({name: cs}, READINGS, draws=2).items()}

    calls, wrapped = [], {}
    for f in readers.values():
        wrapped.setdefault(id(f), lambda x, f=f: calls.append(1) or f(x))
    counted = {name: wrapped[id(f)] for name, f in readers.items()}
    g = torch.Generator().manual_seed(0)
    doc, y = torch.arange(40).repeat_interleave(4), torch.arange(40) % 2
    x_train, x_test = torch.randn(160, 32, generator=g), torch.randn(160, 32, generator=g)
    train = pool_documents(counted, x_train, doc, y)
    assert len(calls) == len(wrapped) < len(readers)  # each distinct reader read once
    alone_train = pool_documents(separate, x_train, doc, y)
    assert all(torch.equal(train.z[name], alone_train.z[name]) for name in readers)
    test, alone_test = pool_documents(readers, x_test, doc, y), pool_documents(separate, x_test, doc, y)
    for reading in READINGS:
        assert probing_lines("toy", train, test, ["neg", "pos"], reading=reading, ks=(1,)) == probing_lines(
            "toy", alone_train, alone_test, ["neg", "pos"], reading=reading, ks=(1,))


def test_a_dense_code_control_reuses_its_activation_controls_product():
    """The code control of a dense set is the one-hot largest cosine of the same random directions its
    activation control reads: `pool_documents` computes that product once per draw, and every column
    equals the one read by a control reader built alone (which computes the product itself)."""
    g = torch.Generator().manual_seed(3)
    mean = torch.randn(32, generator=g)
    sets = {"km": ConceptSet(torch.randn(6, 32, generator=g), SITE, method="kmeans", mean=mean),
            "rnd": ConceptSet(torch.randn(40, 32, generator=g), SITE, method="random", mean=mean)}
    readers = probe_readers(sets, READINGS, draws=3)
    products = []
    for name in sets:
        for r in range(3):
            act, code = readers[column(name, "activation", r)], readers[column(name, "code", r)]
            assert isinstance(code, Derived) and code.base is act
    counted = {}
    for key, f in readers.items():  # count the activation controls' reads through their Derived code columns too
        if isinstance(f, Derived):
            continue
        counted[id(f)] = lambda x, f=f: products.append(1) or f(x)
    wrapped = {key: (Derived(counted[id(f.base)], f.then) if isinstance(f, Derived) else counted[id(f)])
               for key, f in readers.items()}
    doc, y = torch.arange(30).repeat_interleave(5), torch.arange(30) % 2
    x = torch.randn(150, 32, generator=g) * 3 + mean
    part = pool_documents(wrapped, x, doc, y)
    assert len(products) == len(counted) == 2 * 2 + 2 * 3  # each set's two readings, one product per control draw
    for name, cs in sets.items():
        for r in range(3):
            alone = control_reader(cs, 1 + r, "code", random_directions(len(cs), cs.d, 1 + r))
            assert not isinstance(alone, Derived)
            expected = pool_documents({"c": alone}, x, doc, y).z["c"]
            got = part.z[column(name, "code", r)]
            assert torch.equal(got, expected) and got.sum(1).allclose(torch.ones(30))
    # read per token too (TokenColumns calls a Derived reader whole): the same one-hot codes
    key = column("rnd", "code", 0)
    assert torch.equal(readers[key](x), F.one_hot(readers[column("rnd", "activation", 0)](x).argmax(1), 40).float())
