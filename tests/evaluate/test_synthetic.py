"""The synthetic part against SAELens's own evaluation: the same weights on the same rows give the same figures."""

import pytest
import torch
from sae_lens import SAE
from sae_lens.synthetic import eval_sae_on_synthetic_data

from conceptlens.cli import main
from conceptlens.concepts.conceptset import ConceptSet
from conceptlens.concepts.sae import TopKSAE, export_saelens
from conceptlens.evaluate.synthetic import PEER, recovery, seed_interval, set_latents, synthetic_lines
from conceptlens.evaluate.synthetic_data import SeededFeatures, SyntheticConfig, synthetic_model

TINY = SyntheticConfig(num_features=32, hidden_dim=16, k=4, steps=12, batch_size=256, eval_rows=2048, seeds=(0, 1),
                       methods=("topk", "kmeans"))


@pytest.fixture(scope="module")
def model():
    return synthetic_model(TINY)


def test_a_seeded_stream_replays_the_same_rows(model):
    a, b = SeededFeatures(model.activation_generator, 5), SeededFeatures(model.activation_generator, 5)
    first = a(64)
    torch.rand(3)  # the caller's RNG moving in between changes nothing
    assert torch.equal(first, b(64)) and torch.equal(a(64), b(64))
    assert not torch.equal(first, SeededFeatures(model.activation_generator, 6)(64))


def test_no_fit_starts_at_the_generator_dictionary(model):
    from sae_lens.synthetic import mean_correlation_coefficient

    truth = model.feature_dict.feature_vectors.detach()  # SAELens draws it with torch.randn, as our SAEs their decoder
    for seed in range(3):
        start = torch.randn(truth.shape, generator=torch.Generator().manual_seed(seed))
        assert mean_correlation_coefficient(start, truth) < 0.8


@torch.no_grad()
def _rows(model, seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    features = SeededFeatures(model.activation_generator, seed)(n)
    return features, model.feature_dict(features)


def test_mcc_and_f1_equal_saelens_evaluation_of_the_same_weights(model, tmp_path):
    sae = TopKSAE(width=32, k=4, batch_size=256, warmup_tokens=256, seed=0)
    for i in range(12):
        sae.update(_rows(model, 100 + i, 256)[1])
    cs = sae.concept_set()
    export_saelens(cs, tmp_path)
    theirs = eval_sae_on_synthetic_data(SAE.load_from_disk(tmp_path), model.feature_dict,
                                        SeededFeatures(model.activation_generator, 9), num_samples=2048)
    features, x = _rows(model, 9, 2048)  # the rows SAELens drew
    directions, encode = set_latents(cs)
    ours = recovery(directions, encode(x), features, model.feature_dict.feature_vectors.detach())
    assert 0.2 < ours.mcc < 0.999  # a partly trained dictionary: neither trivial nor perfect
    assert ours.mcc == pytest.approx(theirs.mcc, rel=1e-5)
    assert ours.f1 == pytest.approx(theirs.classification.f1_score, abs=1e-3)
    assert ours.l0 == pytest.approx(theirs.sae_l0, abs=1e-2)


def test_a_planted_dictionary_scores_one_and_a_random_one_low(model):
    truth = model.feature_dict.feature_vectors.detach()  # (32, 16)
    g = torch.Generator().manual_seed(0)
    order, scale = torch.randperm(32, generator=g), (torch.rand(32, 1, generator=g) + 0.5) * torch.where(
        torch.rand(32, 1, generator=g) < 0.5, -1.0, 1.0)
    features, _ = _rows(model, 4, 4096)
    known = recovery(truth[order] * scale, features[:, order], features, truth)
    fired = (features > 0).any(0).float().mean().item()  # a latent whose feature never fired has F1 0
    assert known.mcc == pytest.approx(1.0, abs=1e-6)
    assert known.f1 == pytest.approx(fired, abs=1e-6)
    random = ConceptSet(torch.randn(32, 16, generator=g))
    directions, encode = set_latents(random)
    chance = recovery(directions, encode(features @ truth), features, truth)
    assert chance.mcc < 0.6 and chance.f1 < 0.5


def test_seed_interval_is_students_t():
    est = seed_interval([0.5, 0.7, 0.6])
    half = 4.302652729911275 * 0.1 / 3 ** 0.5  # t(0.975, 2) * sd / sqrt(n)
    assert est.value == pytest.approx(0.6) and est.low == pytest.approx(0.6 - half) and est.high == pytest.approx(0.6 + half)


def test_synthetic_lines_put_every_method_beside_saelens_and_random():
    lines = synthetic_lines(TINY)
    assert [(ln.extractor, ln.metric) for ln in lines] == [
        (name, f"synthetic {m}") for m in ("MCC", "F1") for name in ("topk", "kmeans", PEER)]
    for ln in lines:
        assert ln.value.low <= ln.value.value <= ln.value.high
        assert [b for b, _ in ln.baselines] == [b for b in (PEER, "random directions") if b != ln.extractor]
        assert ln.baselines[-1][1].value < 0.7  # the control is not the generator's own dictionary


def test_cli_needs_a_run_folder_except_for_the_synthetic_part(capsys):
    assert main(["eval", "--suite", "probing,synthetic"]) == 2
    err = capsys.readouterr().err
    assert "--suite probing needs a RUN_DIR" in err and "Traceback" not in err


def test_cli_runs_the_synthetic_part_without_a_run(monkeypatch, capsys):
    from dataclasses import dataclass

    from conceptlens.commands import eval as eval_command

    @dataclass
    class Small(SyntheticConfig):
        num_features: int = 32
        hidden_dim: int = 16
        k: int = 4
        batch_size: int = 256
        eval_rows: int = 1024
        methods: tuple[str, ...] = ("topk",)

    monkeypatch.setattr(eval_command, "SyntheticConfig", Small)
    assert main(["eval", "--suite", "synthetic", "--synthetic-seeds", "2", "--synthetic-steps", "4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "Student's t over 2 seeds" in out
    assert "| topk | synthetic MCC |" in out and f"| {PEER} | synthetic F1 |" in out
