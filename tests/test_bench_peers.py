"""benchmarks/peers.py's core comparison on tiny random rows, so the script cannot rot."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _peers  # noqa: E402
import peers  # noqa: E402

D, WIDTH, K, BATCH = 16, 32, 4, 64


def rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 2.0 + torch.randn(n, D, generator=g) @ torch.randn(D, D, generator=g)


def hand_fvu(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    x, x_hat = x.double().numpy(), x_hat.double().numpy()
    residual = sum(float(np.dot(a - b, a - b)) for a, b in zip(x, x_hat))
    mean = x.sum(0) / len(x)
    total = sum(float(np.dot(a - mean, a - mean)) for a in x)
    return residual / total


def run(names: list[str]) -> tuple[dict, dict, torch.Tensor]:
    available = _peers.makers(D, WIDTH, K, BATCH)
    trainers = {name: available[name]() for name in names}
    held_out = rows(256, seed=1)
    curves = peers.compare(trainers, rows(6 * BATCH, seed=0), held_out, BATCH, evals=2)
    return trainers, curves, held_out


def check(trainers: dict, curves: dict, held_out: torch.Tensor) -> None:
    for name, trainer in trainers.items():
        assert [p.tokens for p in curves[name]] == [3 * BATCH, 6 * BATCH]  # evals after steps 3 and 6
        final = curves[name][-1]
        assert 0 < final.first_step <= final.seconds
        assert final.fvu == pytest.approx(hand_fvu(held_out, trainer.reconstruct(held_out)), rel=1e-9)
        assert final.l0 == pytest.approx(K)  # TopK: exactly k latents per row
        assert math.isnan(final.ce_recovered)  # no CE evaluator given


def test_ours_and_saelens_share_one_fvu() -> None:
    pytest.importorskip("sae_lens")
    trainers, curves, held_out = run(["ours-topk", "saelens-topk"])
    check(trainers, curves, held_out)
    assert trainers["ours-topk"].sae.stats().steps == 6  # one optimiser step per batch, as the peers take


def test_saelens_batchtopk_is_scored_as_saelens_deploys_it() -> None:
    """At its learned threshold, row by row (a JumpReLU, as `save_inference_model` writes it and ours is
    scored): the training SAE's encode took top-k over the whole held-out batch."""
    pytest.importorskip("sae_lens")
    trainers, _, held_out = run(["saelens-batchtopk"])
    trainer = trainers["saelens-batchtopk"]
    together, alone = trainer.encode(held_out), torch.cat([trainer.encode(row[None]) for row in held_out[:20]])
    torch.testing.assert_close(together[:20], alone)  # no row's code depends on its neighbours
    sae = trainer.sae
    with torch.no_grad():  # by hand: the pre-activation in decoder-norm units (SAELens's training default),
        pre = (held_out - sae.b_dec) @ sae.W_enc + sae.b_enc  # then ReLU and the threshold
        if sae.cfg.rescale_acts_by_decoder_norm:
            pre = pre * sae.W_dec.norm(dim=1)
        by_hand = torch.relu(pre) * (pre > sae.topk_threshold)
    torch.testing.assert_close(together, by_hand, rtol=1e-5, atol=1e-5)


def test_sparsify_evaluation_leaves_its_training_weights_alone() -> None:
    pytest.importorskip("sparsify")
    pytest.importorskip("schedulefree")
    trainers, curves, held_out = run(["sparsify-topk"])
    check(trainers, curves, held_out)
    trainer = trainers["sparsify-topk"]
    before = [p.detach().clone() for p in trainer.sae.parameters()]
    trainer.reconstruct(held_out)  # swaps in the schedule-free average and back
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.sae.parameters()))


def test_goal_rows_compare_against_the_peers_final_figure() -> None:
    P = peers.Point
    curves = {"ours-topk": [P(100, 1.0, 0.5, 4, math.nan), P(200, 2.0, 0.3, 4, math.nan)],
              "peer": [P(100, 2.0, 0.6, 4, math.nan), P(200, 4.0, 0.4, 4, math.nan)]}
    # ours first reaches 0.4 at 200 tokens and 2.0 s: 1.0x the peer's tokens and 0.5x its time
    (line,) = peers.goal_rows(curves)
    assert "tokens  1.00x" in line and "wall  0.50x" in line and "goal met" in line
    curves["ours-topk"] = [P(200, 3.0, 0.3, 4, math.nan)]  # 0.75x the peer's time
    assert "goal missed" in peers.goal_rows(curves)[0]
    curves["ours-topk"] = [P(200, 1.0, 0.3, 40, math.nan)]  # met, but with 10x the peer's L0
    assert "not comparable" in peers.goal_rows(curves)[0]
    curves["ours-topk"] = [P(200, 1.0, 0.45, 4, math.nan)]
    assert "not reached" in peers.goal_rows(curves)[0]


def test_the_json_it_writes_is_the_atlas_peers_table(tmp_path) -> None:
    from conceptlens.report.evaluation import load_peers, peers_block

    P = peers.Point
    curves = {"ours-topk": [P(100, 1.0, 0.5, 4, math.nan), P(200, 2.0, 0.3, 4, 0.91)],
              "peer": [P(100, 2.0, 0.6, 4, math.nan), P(200, 4.0, 0.4, 4, math.nan)]}
    peers.write_json(curves, tmp_path / "peers.json", "200 tokens")
    data = load_peers(tmp_path)
    assert data["final"] == {"ours-topk": {"tokens": 200, "seconds": 2.0, "fvu": 0.3, "l0": 4, "ce_recovered": 0.91},
                             "peer": {"tokens": 200, "seconds": 4.0, "fvu": 0.4, "l0": 4, "ce_recovered": None}}
    assert data["goals"] == peers.goal_rows(curves) and data["site"] == peers.SITE
    html = peers_block(data)
    assert "<td>ours-topk</td>" in html and '<td class="num">0.91</td>' in html and "goal met" in html


def test_peers_rows_shards_keep_every_piece_and_load_back_shuffled(tmp_path, monkeypatch) -> None:
    import peers_rows

    monkeypatch.setattr(peers_rows, "SHARD_TOKENS", 10)
    pieces = [[0] * n for n in (5, 3, 7, 2, 9, 4, 6)]
    groups = peers_rows.shards(pieces)
    assert sorted(map(len, (p for g in groups for p in g))) == sorted(map(len, pieces))
    assert all(sum(map(len, g)) >= 10 for g in groups[:-1])  # every shard but the last is full
    assert all([len(p) for p in g] == sorted(len(p) for p in g) for g in groups)  # sorted within a shard
    folder = tmp_path / "train-512"
    folder.mkdir()
    x = torch.arange(12.0).repeat(3, 1).T.half()  # (12, 3): row i is i, i, i
    torch.save(x[:5], folder / "shard-000.pt")
    torch.save(x[5:], folder / "shard-001.pt")
    with pytest.raises(FileNotFoundError, match="no complete capture"):
        peers_rows.load_rows(cache=tmp_path)
    (folder / "DONE").write_text("2 shards\n")
    rows = peers_rows.load_rows(cache=tmp_path)
    assert rows.dtype == torch.float16 and sorted(rows[:, 0].tolist()) == list(range(12))
    assert not torch.equal(rows, x)  # shuffled
    assert torch.equal(peers_rows.load_rows(cache=tmp_path, limit=4), rows[:4])  # the same seeded order


def test_lr_variants_scale_each_models_default_lr() -> None:
    from conceptlens.concepts.sae import BatchTopKSAE, JumpReLUSAE, TopKSAE

    available = _peers.makers(D, WIDTH, K, BATCH)
    for arch, cls in (("topk", TopKSAE), ("batchtopk", BatchTopKSAE), ("jumprelu", JumpReLUSAE)):
        default = 2e-4 * math.sqrt(16384 / WIDTH)  # Gao et al.'s rule, the models' default
        assert available[f"ours-{arch}"]().sae.config.learning_rate() == default
        for times in (3, 10):
            sae = available[f"ours-{arch}-lr{times}x"]().sae
            assert type(sae) is cls and sae.config.learning_rate() == times * default


def test_budget_variants_take_the_lr_conceptlens_fit_gives_for_the_runs_steps() -> None:
    """`ours-ARCH-budget`: the lr `conceptlens fit` writes into run.toml for an SAE entry without one
    (`budget_lr`) at a budget of `steps` batches."""
    from conceptlens.commands.extractor_specs import budget_lr

    assert "ours-topk-budget" not in _peers.makers(D, WIDTH, K, BATCH)  # the run's steps unknown
    steps = 37
    available = _peers.makers(D, WIDTH, K, BATCH, steps=steps)
    for arch in ("topk", "batchtopk", "jumprelu"):
        spec = {"method": arch, "width": WIDTH, "batch_size": BATCH}
        lr = available[f"ours-{arch}-budget"]().sae.config.learning_rate()
        assert lr == budget_lr(spec, steps * BATCH) > 2e-4 * math.sqrt(16384 / WIDTH)
