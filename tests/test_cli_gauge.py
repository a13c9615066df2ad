"""`conceptlens gauge`: its per-head table against brute force, and its argument checks."""

import argparse

import pytest
import torch

from conceptlens.cli import build_parser
from conceptlens.commands import gauge
from conceptlens.metrics.gauge import QueryKeyMoments


def _stream(seed=0, n=300, h=4, h_kv=2, d=8):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g)
    q = torch.randn(n, h, d, generator=g) @ mix
    k = torch.randn(n, h_kv, d, generator=g) @ mix.T + 3 * torch.arange(d) / d  # keys share a mean: raw cosines far from 0
    return q.double(), k.double()


def test_head_table_matches_brute_force_over_token_pairs():
    q, k = _stream()
    moments = QueryKeyMoments()
    moments.update(q[:100], k[:100])
    moments.update(q[100:], k[100:])
    table = gauge.head_table(moments, k, n_pairs=500, seed=1)
    d, g = 8, 2
    # every (query token, key token) pair, query heads grouped by their key head (h // g)
    scores = torch.einsum("ihd,jhd->ijh", q, k.repeat_interleave(g, 1)) / d**0.5  # (N, N, H)
    rms = scores.pow(2).mean((0, 1)).view(2, g).mean(1).sqrt()
    torch.testing.assert_close(table.rms_score, rms)
    spec = torch.linalg.eigvals(moments.S_q @ moments.S_k).real.sort(descending=True).values
    p = spec / spec.sum(-1, keepdim=True)
    torch.testing.assert_close(table.spectrum_rank, torch.exp(-(p * p.log()).sum(-1)))
    torch.testing.assert_close(table.top_share, p[:, 0])
    assert table.group_size == g and (table.cosine_mean.abs() <= 1).all()
    # pairs are reproducible and never pair a key with itself
    again = gauge.head_table(moments, k, n_pairs=500, seed=1)
    assert torch.equal(again.distance_mean, table.distance_mean)
    twins = gauge.head_table(moments, k[:1].expand(2, -1, -1).clone(), n_pairs=50)
    assert torch.all(twins.distance_mean == 0)  # two copies of one key: every pair is (0, 1) or (1, 0)
    torch.testing.assert_close(twins.cosine_mean, torch.ones(2, dtype=torch.float64))


def test_the_rms_score_uses_the_models_own_scaling():
    q, k = _stream()
    moments = QueryKeyMoments()
    moments.update(q, k)
    scores = torch.einsum("ihd,jhd->ijh", q, k.repeat_interleave(2, 1)) * 0.1  # a model scaling by 0.1, not 8^-0.5
    want = scores.pow(2).mean((0, 1)).view(2, 2).mean(1).sqrt()
    torch.testing.assert_close(gauge.head_table(moments, k, n_pairs=10, scaling=0.1).rms_score, want)


def test_gauge_prints_gemmas_scores_at_its_query_pre_attn_scalar(tmp_path, capsys):
    """Gemma scales q.k by query_pre_attn_scalar^-0.5, not head_dim^-0.5: the same weights with a scalar
    4 times smaller print an rms score twice as large."""
    import transformers as tf

    from conceptlens.cli import main
    from tests.conftest import _LLAMA_LIKE
    from tests.steering.test_sweep import word_tokenizer

    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(" ".join(f"w{(7 * i + j) % 90 + 3}" for j in range(12)) for i in range(12)) + "\n")
    rms = []
    for scalar in (32, 8):
        torch.manual_seed(0)
        folder = tmp_path / f"gemma{scalar}"
        config = tf.Gemma3TextConfig(**_LLAMA_LIKE, head_dim=8, query_pre_attn_scalar=scalar)
        tf.Gemma3ForCausalLM(config).save_pretrained(folder)
        word_tokenizer().save_pretrained(folder)
        assert main(["gauge", "--model", str(folder), "--layer", "1", "--data", str(texts), "--max-tokens", "100",
                     "--max-length", "16", "--sample-docs", "2", "--pairs", "50"]) == 0
        out = capsys.readouterr().out
        rows = out[out.index("key head"):out.index("columns (per key head")].strip().splitlines()[1:]
        rms.append(torch.tensor([float(row.split()[4]) for row in rows]))
    torch.testing.assert_close(rms[1], 2 * rms[0], rtol=0.01, atol=0.002)


def test_head_table_invariant_columns_ignore_a_gauge():
    q, k = _stream(seed=2)
    g = torch.Generator().manual_seed(3)
    A = torch.linalg.qr(torch.randn(2, 8, 8, generator=g, dtype=torch.float64)).Q * torch.linspace(0.5, 2, 8)
    q2 = torch.einsum("hab,nhb->nha", A.repeat_interleave(2, 0), q)
    k2 = torch.einsum("hab,nhb->nha", torch.linalg.inv(A).transpose(-1, -2), k)
    tables = []
    for qq, kk in ((q, k), (q2, k2)):
        m = QueryKeyMoments()
        m.update(qq, kk)
        tables.append(gauge.head_table(m, kk, n_pairs=400))
    for field in ("spectrum_rank", "top_share", "rms_score", "distance_mean", "distance_median",
                  "cosine_mean", "cosine_std"):
        torch.testing.assert_close(getattr(tables[0], field), getattr(tables[1], field), rtol=1e-8, atol=1e-10)
    assert ((tables[0].raw_cosine - tables[1].raw_cosine).abs() > 0.05).all(), (tables[0].raw_cosine, tables[1].raw_cosine)
    assert len(gauge.format_table(tables[0]).splitlines()) == 3


def test_every_column_has_a_unit_and_a_definition():
    q, k = _stream()
    moments = QueryKeyMoments()
    moments.update(q, k)
    header = gauge.format_table(gauge.head_table(moments, k, n_pairs=10)).splitlines()[0]
    columns = [name for name, _, _ in gauge.LEGEND]
    assert all(name in header for name in columns) and len(columns) == 8
    legend = gauge.format_legend().splitlines()
    assert len(legend) == 9 and all(len(line.split("  ")) >= 3 for line in legend[1:])
    assert "logits^2" in legend[4] and "NOT gauge-invariant" in legend[-1]


def test_head_table_needs_two_keys():
    m = QueryKeyMoments()
    m.update(*_stream(n=5))
    with pytest.raises(ValueError, match="at least two keys"):
        gauge.head_table(m, torch.zeros(1, 2, 8), n_pairs=3)


def test_gauge_arguments_are_checked(capsys):
    with pytest.raises(SystemExit):  # checked while parsing, before the model loads
        build_parser().parse_args(["gauge", "--layer", "3", "--pairs", "0"])
    assert "--pairs: 0 is not a positive integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gauge", "--group", "orthogonal"])
    assert "invalid choice: 'orthogonal'" in capsys.readouterr().err


@pytest.mark.real_model
def test_gauge_command_on_smollm2(capsys, tmp_path):
    from conceptlens.cli import main

    texts = tmp_path / "texts.txt"
    texts.write_text("The bank raised interest rates on Tuesday.\nA cat sat on the mat and slept all day.\n" * 4)
    code = main(["gauge", "--layer", "1", "--data", str(texts), "--max-tokens", "100", "--sample-docs", "2",
                 "--pairs", "100"])
    out = capsys.readouterr().out
    assert code == 0
    table = out[out.index("key head"):out.index("columns (per key head")].strip().splitlines()
    assert [row.split()[:2] for row in table[1:]] == [["0", "0-2"], ["1", "3-5"], ["2", "6-8"]]  # GQA: 9 q, 3 kv heads
    legend = out[out.index("columns (per key head"):out.index("gauge audit")].strip().splitlines()
    assert len(legend) == 9 and "logits^2" in out  # every column with its unit
    audit = {line.split()[0]: line.split()[-1] for line in out[out.index("gauge audit"):].splitlines()[1:]}
    assert audit == {"key_norm": "moved", "key_cosine": "moved", "key_pca": "moved",
                     "key_distance": "invariant", "score_cosine": "invariant", "qk_spectrum": "invariant"}


def test_a_model_that_normalises_q_and_k_gets_the_table_and_a_one_line_reason_for_no_audit(tmp_path, capsys):
    """Qwen3 (and Gemma-3) normalise q and k per head: the audit cannot move its weights along the gauge.
    It raised NotImplementedError after the whole pass; the table is still the streamed q/k's."""
    import transformers as tf

    from conceptlens.cli import main
    from tests.conftest import _LLAMA_LIKE
    from tests.steering.test_sweep import word_tokenizer

    torch.manual_seed(0)
    tf.Qwen3ForCausalLM(tf.Qwen3Config(**_LLAMA_LIKE, head_dim=8)).save_pretrained(tmp_path / "qwen3")
    word_tokenizer().save_pretrained(tmp_path / "qwen3")
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(" ".join(f"w{(7 * i + j) % 90 + 3}" for j in range(12)) for i in range(12)) + "\n")
    code = main(["gauge", "--model", str(tmp_path / "qwen3"), "--layer", "1", "--data", str(texts),
                 "--max-tokens", "100", "--max-length", "16", "--sample-docs", "2", "--pairs", "50"])
    out = capsys.readouterr().out
    assert code == 0
    reason = ("gauge audit left out: qwen3: model.layers.0.self_attn normalises q/k (q_norm/k_norm); a gauge of "
              "W_Q/W_K would change the normalised vectors")
    assert out.index(reason) < out.index("tokens in") < out.index("key head") < out.rindex(reason)  # before the pass
    assert len(out[out.index("key head"):out.index("columns (per key head")].strip().splitlines()) == 3
