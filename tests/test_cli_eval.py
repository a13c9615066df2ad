"""`conceptlens eval` and `conceptlens.evaluate` (activations, the quality table): label alignment, concept
activations, the metric table, argument errors."""

import math

import pytest
import torch
import torch.nn.functional as F

import conceptlens
from conceptlens.cli import main
from conceptlens.evaluate import activations as ev
from conceptlens.evaluate import table
from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.concepts.sae import TopKSAE
from conceptlens.concepts.vq import VQCodebook
from conceptlens.metrics.quality import dead_fraction, fvu, l0, standardised_probe_loss
from tests.conftest import tiny_model


def test_first_subtoken_labels_align_tags_with_tokens():
    words = ["The", "banker", "s", ",", "left"]  # text: "The banker s , left"
    spans = ev.word_spans(words)
    assert spans.tolist() == [[0, 3], [4, 10], [11, 12], [13, 14], [15, 19]]
    # <s> | "The" | " bank" | "er" | " s" | " " | "," | (truncated before "left") | pad
    offsets = torch.tensor([[0, 0], [0, 3], [3, 8], [8, 10], [10, 12], [12, 13], [13, 14], [0, 0]])
    labels = ev.first_subtoken_labels(offsets, spans, torch.tensor([10, 11, 12, 13, 14]))
    assert labels.tolist() == [-1, 10, 11, -1, 12, -1, 13, -1]


def test_recon_stats_stream_equals_the_full_tensor_metrics():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 6, generator=g) * 4 + 2
    x_hat = x + torch.randn(300, 6, generator=g)
    z = torch.relu(torch.randn(300, 10, generator=g) - 1)
    z[:, 7] = 0  # a dead concept
    stats = table.ReconStats()
    for rows in torch.arange(300).split(70):
        stats.update(x[rows], z[rows], x_hat[rows])
    assert stats.fvu() == pytest.approx(fvu(x, x_hat), rel=1e-10)
    assert stats.l0() == pytest.approx(l0(z), rel=1e-12)
    assert stats.dead_fraction() == dead_fraction(z) == 0.1


def test_concept_encoders_reproduce_the_extractors_they_came_from():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(600, 8, generator=g)
    sae = TopKSAE(width=16, k=3, batch_size=64, warmup_tokens=100, buffer_size=128, seed=0)
    sae.update(x)
    sae.flush()
    enc = ev.concept_encoder(sae.concept_set())
    torch.testing.assert_close(enc.encode(x), sae.encode(x))
    torch.testing.assert_close(enc.decode(enc.encode(x)), sae.reconstruct(x))

    vq = VQCodebook(8, init_size=200, seed=0)
    vq.update(x)
    vq.flush()
    enc = ev.concept_encoder(vq.concept_set())
    assert torch.equal(enc.encode(x), vq.encode(x))
    assert torch.equal(enc.decode(enc.encode(x)), vq.quantize(x))

    directions = torch.randn(5, 8, generator=g)
    mean = x.mean(0) + 0.5
    enc = ev.concept_encoder(ConceptSet(directions, method="kmeans", mean=mean))  # cosine to the centred centroid
    expected = F.normalize(x - mean, dim=1) @ F.normalize(directions - mean, dim=1).T
    assert enc.decode is None
    torch.testing.assert_close(enc.encode(x), expected)


def _synthetic(n=400, seed=2):
    """Labels 0/1/2; concept 4 fires for class 1 only; class 2 shifts x along e_0 (= concept 6)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    x = torch.randn(n, 8, generator=g)
    x[:, 0] += 3.0 * (y == 2)
    directions = torch.randn(7, 8, generator=g)
    directions[6] = torch.nn.functional.one_hot(torch.tensor(0), 8).float()
    z = torch.randn(n, 7, generator=g)
    z[:, 4] += 4.0 * (y == 1)
    return table.Features(x, z, y), directions


def test_metric_rows_find_planted_concepts():
    (train, directions), (test, _) = _synthetic(seed=2), _synthetic(seed=3)
    rows = table.metric_rows(directions, train, test, ["a", "b", "c"], candidates=None)
    names = [r.metric for r in rows]
    reference = standardised_probe_loss(train.z, train.y, test.z, test.y)
    assert names[:4] == ["probe loss (median class)", "  a", "  b", "  c"]
    assert rows[0].value == pytest.approx(reference.loss)
    assert rows[2].note == "concept 4" and rows[2].value < 0.1
    assert "FVU" not in names  # a plain direction set does not reconstruct
    lda = rows[names.index("LDA cosine (median class)") + 3]
    assert lda.metric == "  c" and lda.note == "concept 6" and lda.value > 0.9  # class c's LDA points along e_0
    assert rows[names.index("effective rank")].value <= 7
    # the screen keeps the planted concept, so the probe of class b is unchanged
    screened = table.metric_rows(directions, train, test, ["a", "b", "c"], candidates=2)
    assert screened[2] == rows[2] and "(of " in screened[0].note


def test_every_quality_figure_has_its_baseline():
    from sklearn.metrics import log_loss

    (train, directions), (test, _) = _synthetic(seed=2), _synthetic(seed=3)
    y_test = test.y.clone()
    y_test[:40] = 0  # test rates differ from train rates: the baseline is a cross-entropy, not an entropy
    test = table.Features(test.x, test.z, y_test)
    recon = table.ReconStats()
    recon.update(test.x, test.z, test.x * 0.5)
    rows = table.metric_rows(directions, train, test, ["a", "b", "c"], recon, candidates=None)
    by_name = {r.metric: r for r in rows}
    for i, c in enumerate(("a", "b", "c")):
        rate = float((train.y == i).double().mean())
        expected = log_loss((y_test == i).numpy(), [rate] * len(y_test), labels=[False, True])
        assert rows[1 + i].baseline == pytest.approx(expected) and rows[1 + i].baseline_name == "base-rate entropy"
    assert rows[0].baseline == pytest.approx(float(torch.tensor([r.baseline for r in rows[1:4]]).median()))
    assert by_name["FVU"].baseline == 1.0 and by_name["FVU"].value == pytest.approx(0.25 * recon.sq / (
        recon.sq - float(recon.sum.pow(2).sum()) / recon.n))
    assert 0 < by_name["LDA cosine (median class)"].baseline < 0.9  # 7 random directions in 8 dims
    text = table.format_rows(rows)
    assert text.splitlines()[0].split()[:3] == ["metric", "value", "baseline"]
    assert "vs base-rate entropy 0.6" in text and "vs mean predictor 1.0000" in text
    assert table.baseline_warnings(rows) == []
    noise = table.Features(train.x, torch.randn(len(train.y), 7, generator=torch.Generator().manual_seed(9)), train.y)
    useless = table.metric_rows(directions, noise, test, ["a", "b", "c"], candidates=None)
    warnings = table.baseline_warnings(useless)
    assert len(warnings) == 1 and "classes' probes do no better than their base-rate entropy" in warnings[0]


def test_probe_candidates_rank_by_standardised_mean_difference():
    z = torch.zeros(6, 4)
    y = torch.tensor([0, 0, 0, 1, 1, 1])
    z[:, 2] = torch.tensor([0.0, 0.1, 0.0, 5.0, 5.1, 5.0])  # separates the classes
    z[:, 1] = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])  # noise
    assert table.probe_candidates(z, y, per_class=1).tolist() == [2]
    assert table.probe_candidates(z, y, per_class=9).tolist() == [0, 1, 2, 3]


def test_collect_pools_documents_and_picks_labelled_tokens():
    model = tiny_model("llama")
    lens = conceptlens.attach(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 99, (3, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 4:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    with torch.no_grad():
        hidden = model(**batch, output_hidden_states=True).hidden_states[1]  # after block 0 (the last one is normed)
    directions = torch.randn(5, 32, generator=g)
    enc = {"dirs": ev.concept_encoder(ConceptSet(directions))}
    docs = ev.collect(lens, "blocks.0.resid_out", enc, [(batch, torch.tensor([1, 0, 1]))] * 2)
    expected = torch.stack([hidden[r, 1:int(mask[r].sum())].mean(0) for r in range(3)])  # first token left out
    torch.testing.assert_close(docs.x, expected.repeat(2, 1), rtol=1e-5, atol=1e-5)
    cos = [F.normalize(hidden[r, 1:int(mask[r].sum())], dim=1) @ F.normalize(directions, dim=1).T for r in range(3)]
    torch.testing.assert_close(docs.z["dirs"], torch.stack([c.mean(0) for c in cos]).repeat(2, 1), rtol=1e-4, atol=1e-4)
    assert docs.y.tolist() == [1, 0, 1] * 2 and docs.doc.tolist() == [0, 1, 2, 3, 4, 5]  # ids run across batches
    tags = torch.full((3, 6), -1)
    tags[0, 0], tags[0, 3], tags[1, 5], tags[2, 5] = 7, 8, 9, 4  # position 0 and padding never count
    tokens = ev.collect(lens, "blocks.0.resid_out", enc, [(batch, tags)])
    assert tokens.y.tolist() == [8, 9] and tokens.doc.tolist() == [0, 1]
    torch.testing.assert_close(tokens.x, torch.stack([hidden[0, 3], hidden[1, 5]]), rtol=1e-5, atol=1e-5)


def test_load_concepts_from_a_set_or_a_checkpoint_dir(tmp_path):
    cs = ConceptSet(torch.randn(3, 4), site="blocks.0.resid_out")
    cs.save(tmp_path / "one")
    assert torch.equal(ev.load_concepts(tmp_path / "one").directions, cs.directions)
    cs.save(tmp_path / "run" / "concepts" / "blocks.0.resid_out")
    assert ev.load_concepts(tmp_path / "run").site == "blocks.0.resid_out"
    cs.save(tmp_path / "run" / "concepts" / "other")
    with pytest.raises(ValueError, match=r"holds 2 sets; choose one with --concepts: \['blocks.0.resid_out', 'other'\]"):
        ev.load_concepts(tmp_path / "run")
    assert ev.load_concepts(tmp_path / "run", "other").site == "blocks.0.resid_out"
    with pytest.raises(ValueError, match="no concept set 'third'"):
        ev.load_concepts(tmp_path / "run", "third")
    with pytest.raises(FileNotFoundError, match="neither a ConceptSet"):
        ev.load_concepts(tmp_path / "empty")


def test_cli_argument_errors(tmp_path, capsys):
    assert main(["eval", str(tmp_path), "--task", "imdb"]) == 2
    assert "unknown task imdb; choose from bbc-news, movie-polarity, wsj-pos" in capsys.readouterr().err
    assert main(["eval", str(tmp_path), "--suite", "probing,axbench"]) == 2
    err = capsys.readouterr().err
    assert "unknown suite axbench; choose from reconstruction, probing, absorption" in err and "steering" in err
    assert main(["eval", str(tmp_path), "--task", "bbc-news"]) == 2
    assert "neither a ConceptSet" in capsys.readouterr().err
    assert main(["eval", str(tmp_path), "--task", "bbc-news", "--max-docs", "0"]) == 2
    assert "--max-docs: 0 is not a positive integer" in capsys.readouterr().err
    assert main(["eval", str(tmp_path), "--concept-top", "-1"]) == 2
    assert "--concept-top: -1 is not a count" in capsys.readouterr().err
    assert main(["eval", str(tmp_path), "--max-length", "1"]) == 2
    assert "--max-length: 1 is not a document length (the first position is left out" in capsys.readouterr().err
    assert main(["eval", str(tmp_path), "--absorption-words", "4"]) == 2
    assert "--absorption-words 4: absorption needs at least 5 words" in capsys.readouterr().err
    ConceptSet(torch.randn(3, 4)).save(tmp_path / "nosite")
    assert main(["eval", str(tmp_path / "nosite"), "--task", "wsj-pos"]) == 2
    assert "names no site" in capsys.readouterr().err
    ConceptSet(torch.randn(3, 4), site="blocks.0.resid_out").save(tmp_path / "nomodel")
    assert main(["eval", str(tmp_path / "nomodel"), "--task", "wsj-pos"]) == 2
    assert "names no model; pass --model" in capsys.readouterr().err
    ConceptSet(torch.randn(3, 4), site="blocks.0.resid_out", model="tiny").save(tmp_path / "held" / "concepts" / "a")
    assert main(["eval", str(tmp_path / "held"), "--ks", "1,5", "--task", "wsj-pos"]) == 2
    assert "--ks 5 is more latents than a has (3): a k-sparse probe chooses k of them" in capsys.readouterr().err
    (tmp_path / "held" / "eval.json").write_text('{"format": "conceptlens.Evaluation", "version": 1, "model": "tiny", '
                                                 '"sets": {}, "parts": [], "lines": []}')
    before = (tmp_path / "held" / "eval.json").read_bytes()
    assert main(["eval", str(tmp_path / "held"), "--model", "smollm2-135m", "--task", "wsj-pos"]) == 2
    err = capsys.readouterr().err  # refused before the model loads
    assert "holds figures of the model 'tiny', not 'smollm2-135m': pass --model 'tiny'" in err
    assert err.count("\n") == 1 and (tmp_path / "held" / "eval.json").read_bytes() == before
    from conceptlens.commands import _common

    def loaded(*args, **kwargs):
        raise ValueError("the model loads")

    with pytest.MonkeyPatch.context() as patch:  # --no-save writes nothing there: the other model's file is no bar
        patch.setattr(_common, "load_model", loaded)
        assert main(["eval", str(tmp_path / "held"), "--model", "smollm2-135m", "--task", "wsj-pos", "--no-save"]) == 2
        assert "the model loads" in capsys.readouterr().err
    for recorded, why in (('model = ["a"]\n', "model must be a name (a non-empty string); got ['a']"),
                          ('data = "bbc-news"\n', "model must be a name (a non-empty string); got None"),
                          ('model = "tiny"\nshuffle = "yes"\n', "shuffle must be a seed"), ("model = \n", "")):
        (tmp_path / "held" / "run.toml").write_text(recorded)  # a list, no model key, not TOML: one line each
        assert main(["eval", str(tmp_path / "held"), "--task", "wsj-pos"]) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path / 'held' / 'run.toml'}" in err and why in err and err.count("\n") == 1, err
        assert "Traceback" not in err


@pytest.mark.real_model
def test_eval_command_on_smollm2_with_an_sae_set(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    sae = TopKSAE(width=32, k=4, batch_size=64, warmup_tokens=100, buffer_size=128, seed=0)
    sae.update(torch.randn(400, 576, generator=g) * 5)
    sae.flush()
    cs = sae.concept_set()
    cs.site, cs.model = "blocks.1.resid_out", "smollm2-135m"
    cs.save(tmp_path / "run" / "concepts" / "sae")
    code = main(["eval", str(tmp_path / "run"), "--suite", "reconstruction,probing", "--task", "movie-polarity",
                 "--max-docs", "24", "--ce-docs", "4", "--ks", "1,2", "--random-draws", "2", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "bootstrap over held-out documents" in out
    rows = {cells[2]: cells[3:] for line in out.splitlines() if line.startswith("| sae |")
            for cells in [[c.strip() for c in line.split("|")]]}
    assert {"FVU", "CE loss recovered", "KL to clean (nats/token)", "L0", "dead fraction",
            "dense fraction (>10% of tokens)", "movie-polarity k=1 accuracy", "movie-polarity k=2 accuracy"} <= set(rows), out
    assert rows["L0"][0].startswith("4.0000 [4.0000, 4.0000]")
    assert "mean-ablation" in rows["CE loss recovered"][1] and "random 32 dirs" in rows["movie-polarity k=1 accuracy"][1]
    # both readings by default: the SAE's TopK code against a random TopK encoder of its width
    assert rows["movie-polarity k=2 accuracy, codes"][1].startswith("random 32 dirs, codes")
    assert math.isfinite(float(rows["CE loss recovered"][0].split()[0]))
    # every printed figure is saved in the run folder, with the per-concept scores the table leaves out
    from conceptlens.evaluate.results import load_results

    saved = load_results(tmp_path / "run")
    assert saved.model == "smollm2-135m" and saved.sets["sae"].sha256 is not None
    assert {p["part"] for p in saved.parts} == {"reconstruction", "probing movie-polarity"}
    whole = {sl.line.metric: str(sl.line.value) for sl in saved.lines if sl.line.concept is None}
    assert whole == {metric: cells[0] for metric, cells in rows.items()}
    alone = [sl.line for sl in saved.lines if sl.line.concept is not None]
    assert len(alone) == 5 and f"{len(alone)} per-concept scores" in out
    assert "the random control pools its 2 draws" in out
    code = main(["eval", str(tmp_path / "run"), "--suite", "reconstruction", "--ce-docs", "2", "--no-progress",
                 "--no-save"])
    out = capsys.readouterr().out
    assert code == 0 and "bootstrap over held-out documents" in out
    assert "random control" not in out and "Probes" not in out  # no part of this suite has either


def test_a_run_folder_evaluates_with_the_model_its_run_loaded(tmp_path):
    """A set fitted from a local folder or .gguf names the model by its last component only: the run's
    run.toml holds the path that loads it."""
    import argparse

    from conceptlens.commands.eval import _model_name

    sets = {"topk": ConceptSet(torch.eye(4), "blocks.0.resid_out", model="gemma-3-270m-q4_k_m")}
    (tmp_path / "run.toml").write_text('model = "/models/gemma-3-270m-q4_k_m.gguf"\n')
    assert _model_name(argparse.Namespace(run_dir=tmp_path, model=None), sets) == "/models/gemma-3-270m-q4_k_m.gguf"
    assert _model_name(argparse.Namespace(run_dir=tmp_path, model="smollm2-135m"), sets) == "smollm2-135m"
    (tmp_path / "run.toml").unlink()  # a folder of saved sets only: the one model they name
    assert _model_name(argparse.Namespace(run_dir=tmp_path, model=None), sets) == "gemma-3-270m-q4_k_m"


def test_a_run_folder_tells_the_probes_which_documents_its_fit_read(tmp_path):
    from conceptlens.commands.eval import _fit_read

    assert _fit_read(tmp_path) is None  # a folder of saved sets only
    (tmp_path / "fit_report.json").write_text('{"documents": 320}')
    (tmp_path / "run.toml").write_text('model = "smollm2-135m"\ndata = "bbc-news:train"\nshuffle = 3\n')
    assert _fit_read(tmp_path) == ("bbc-news:train", 3, 320)
    (tmp_path / "run.toml").write_text('model = "smollm2-135m"\ndata = "movie-polarity"\nshuffle = false\n')
    assert _fit_read(tmp_path) == ("movie-polarity", None, 320)  # --no-shuffle: the stored order
    (tmp_path / "run.toml").write_text('model = "smollm2-135m"\ndata = "movie-polarity"\n')  # the train split,
    assert _fit_read(tmp_path) == ("movie-polarity", 0, 320)  # in the order a fit gives when no shuffle is set
    ConceptSet(torch.randn(3, 4), site="blocks.0.resid_out").save(tmp_path / "concepts" / "topk")
    assert _fit_read(tmp_path / "concepts" / "topk") == ("movie-polarity", 0, 320)  # a set of the run: its fit's
    for data in ("bbc-news:test", "bbc-news:all"):  # a fit over test articles too: the probes are scored on none
        (tmp_path / "run.toml").write_text(f'model = "smollm2-135m"\ndata = "{data}"\n')
        assert _fit_read(tmp_path) == (data, 0, 320)
    (tmp_path / "run.toml").write_text('model = "smollm2-135m"\ndata = "wikitext"\n')  # a set the probes do not use
    assert _fit_read(tmp_path) is None
