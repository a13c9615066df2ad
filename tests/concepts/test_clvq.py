"""CLVQTranscoder: learns a cross-site map through its codes, keeps its encoder mix in
[0, 0.5], uses sequence context when asked, and resumes bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conceptlens.concepts.clvq import CLVQTranscoder, pad_sequences
from conceptlens.concepts.conceptset import ConceptSet
from tests.conftest import assert_same_state


@pytest.fixture(autouse=True)
def one_thread():
    # These tensors are tiny: on a shared 2-core machine thread hand-offs cost more than math.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def cross_site(n_clusters=16, d_src=16, d_tgt=12, *, seed=0, context=0.0):
    """Sampler of aligned (source, target) rows: a clustered source and a nonlinear target.

    With context > 0 the target also depends on the previous token of the same sequence
    (sequences of 16 tokens): n -> (src, tgt, sequence_ids).
    """
    gen = torch.Generator().manual_seed(seed)
    centres = 3 * torch.randn(n_clusters, d_src, generator=gen)
    w1, w2 = torch.randn(d_src, 32, generator=gen) / 4, torch.randn(32, d_tgt, generator=gen)
    w3 = torch.randn(d_src, d_tgt, generator=gen) / 3

    def draw(n: int):
        src = centres[torch.randint(n_clusters, (n,), generator=gen)]
        src = src + 0.2 * torch.randn(n, d_src, generator=gen)
        ids = torch.arange(n) // 16
        prev = torch.where((torch.arange(n) % 16 == 0)[:, None], 0.0, src.roll(1, 0))
        return src, torch.tanh(src @ w1) @ w2 + context * prev @ w3, ids
    return draw


def held_out_fvu(tc: CLVQTranscoder, draw, transformer: bool = False) -> float:
    src, tgt, ids = draw(2048)
    pred = tc.reconstruct(src, ids if transformer else None)
    return ((tgt - pred).pow(2).sum() / (tgt - tgt.mean(0)).pow(2).sum()).item()


def fit(draw, steps: int, transformer: bool = False, **kwargs) -> CLVQTranscoder:
    options = dict(hidden=64, batch_size=256, lr=3e-3, layers=1, heads=2,
                   codebook=dict(init_size=256)) | kwargs
    tc = CLVQTranscoder(16, decoder="transformer" if transformer else "mlp", **options)
    for _ in range(steps):
        src, tgt, ids = draw(256)
        tc.update(src, tgt, ids if transformer else None)
    return tc


def test_transcoder_reconstructs_a_function_of_a_clustered_source():
    draw = cross_site()
    tc = fit(draw, 60)
    assert tc.steps == 56                     # 59 batches after init; the buffer holds 3
    tc.flush()
    stats = tc.stats()
    assert held_out_fvu(tc, draw) < 0.15
    assert stats.fvu < 0.5 and stats.usage > 0.9 and stats.steps == 59
    assert 0.0 <= stats.mix <= 0.5 and stats.mix != pytest.approx(0.5 * torch.sigmoid(torch.tensor(0.2)).item())
    # (alpha was trained: it starts at 0.2, the paper's, a mix of 0.275)


def test_encoder_is_the_bounded_residual_mix_by_hand():
    from conceptlens.concepts.clvq_modules import ResidualEncoder

    assert ResidualEncoder(16).alpha.item() == pytest.approx(0.2)  # the released code's start
    tc = fit(cross_site(), 2)
    enc = tc.encoder
    h = torch.randn(5, 16)
    a = 0.5 * torch.sigmoid(enc.alpha)
    by_hand = (1 - a) * h + a * F.layer_norm(h @ enc.linear.weight.T + enc.linear.bias, (16,),
                                             enc.norm.weight, enc.norm.bias)
    torch.testing.assert_close(enc(h), by_hand)
    for alpha, expected in [(-50.0, 0.0), (0.0, 0.25), (50.0, 0.5)]:
        enc.alpha.data.fill_(alpha)
        assert enc.mix.item() == pytest.approx(expected, abs=1e-6)


def test_gradients_pass_the_codes_to_the_encoder_and_predictions_use_the_codes():
    tc = fit(cross_site(), 1, buffer_size=256)      # initialised, no step yet
    before = tc.encoder.linear.weight.clone()
    src, tgt, _ = cross_site(seed=1)(256)
    tc.update(src, tgt)
    assert tc.steps == 1 and not torch.equal(before, tc.encoder.linear.weight)
    with torch.no_grad():
        codes = tc.vq.codes[tc.vq.assign(tc.encoder(src))]
        torch.testing.assert_close(tc.reconstruct(src), tc.decode(codes))
        assert torch.equal(tc.encode(src).argmax(1), tc.vq.assign(tc.encoder(src)))


def test_transformer_decoder_uses_the_previous_token():
    draw = cross_site(context=1.0)
    mlp, seq = fit(draw, 60), fit(draw, 60, transformer=True)
    mlp_fvu, seq_fvu = held_out_fvu(mlp, draw), held_out_fvu(seq, draw, transformer=True)
    assert seq_fvu < 0.7 * mlp_fvu, (seq_fvu, mlp_fvu)


def test_pad_sequences_groups_rows_in_order():
    h = torch.arange(10.0).view(5, 2)
    padded, padding, (seq, pos) = pad_sequences(h, torch.tensor([5, 3, 5, 3, 3]))
    # sequence 3 holds rows 1, 3, 4; sequence 5 holds rows 0, 2
    assert torch.equal(padded[0], h[[1, 3, 4]])
    assert torch.equal(padded[1, :2], h[[0, 2]]) and torch.equal(padded[1, 2], torch.zeros(2))
    assert torch.equal(padding, torch.tensor([[False, False, False], [False, False, True]]))
    assert torch.equal(padded[seq, pos], h)


@pytest.mark.parametrize("transformer", [False, True])
def test_resume_from_a_saved_state_is_bit_identical(tmp_path, transformer):
    draw = cross_site(seed=2)
    stream = [draw(100 + 37 * (i % 3)) for i in range(12)]
    make = lambda: CLVQTranscoder(8, hidden=32, batch_size=64, layers=1, heads=2, seed=3,   # noqa: E731
                                  decoder="transformer" if transformer else "mlp",
                                  codebook=dict(init_size=128, reseed_after=3))
    whole, first, resumed = make(), make(), make()
    for src, tgt, ids in stream:
        whole.update(src, tgt, ids)
    for src, tgt, ids in stream[:5]:
        first.update(src, tgt, ids)
    torch.save(first.state_dict(), tmp_path / "tc.pt")
    resumed.load_state_dict(torch.load(tmp_path / "tc.pt", weights_only=True))
    for src, tgt, ids in stream[5:]:
        resumed.update(src, tgt, ids)
    assert whole.steps > 10
    assert_same_state(whole.state_dict(), resumed.state_dict())
    src = stream[0][0]
    assert torch.equal(whole.reconstruct(src, stream[0][2]), resumed.reconstruct(src, stream[0][2]))


def test_concept_set_holds_codes_and_what_they_write(tmp_path):
    tc = fit(cross_site(), 6)
    cs = tc.concept_set()
    assert cs.method == "clvq" and torch.equal(cs.directions, tc.vq.codes)
    with torch.no_grad():
        torch.testing.assert_close(cs.stats["decoded"], tc.decode(tc.vq.codes))
    loaded = ConceptSet.load(cs.save(tmp_path / "cs"))
    assert loaded.stats["decoded"].shape == (16, 12) and loaded.config["d_target"] == 12
    assert loaded.encoder["alpha"].item() == tc.encoder.alpha.item()
    assert loaded[3].stats["decoded"].shape == (1, 12)


@pytest.mark.parametrize("transformer", [False, True])
def test_flush_initialises_a_short_stream_and_trains_on_what_is_held(transformer):
    src, tgt, ids = cross_site(seed=4)(200)
    tc = CLVQTranscoder(16, hidden=32, batch_size=64, heads=2, layers=1, codebook=dict(init_size=256),
                        decoder="transformer" if transformer else "mlp")
    tc.update(src, tgt, ids if transformer else None)
    assert not tc.vq.is_initialised
    tc.flush()                                  # 200 < init_size rows: initialise on them
    assert tc.vq.codes.shape == (16, 16) and tc.steps == 0
    tc.update(src[:100], tgt[:100], ids[:100] if transformer else None)
    tc.flush()                                  # 100 rows in batches of 64: steps of 64 and 36
    assert tc.steps == 2 and tc.vq.tokens == 100


def test_bad_settings_and_inputs_are_named():
    with pytest.raises(ValueError, match="decoder must be one of"):
        CLVQTranscoder(8, decoder="rnn")
    with pytest.raises(ValueError, match="unknown codebook options \\['k'\\]"):
        CLVQTranscoder(8, codebook={"k": 3})
    with pytest.raises(ValueError, match="needs sequence_ids"):
        tc = CLVQTranscoder(8, decoder="transformer", hidden=8, heads=2)
        tc.update(torch.randn(4, 3), torch.randn(4, 2))
    tc = CLVQTranscoder(8)
    assert tc.stats().steps == 0
    with pytest.raises(ValueError, match="aligned"):
        tc.update(torch.randn(4, 3), torch.randn(5, 2))
    with pytest.raises(RuntimeError, match="not initialised"):
        tc.encode(torch.randn(4, 3))
    tc.merge(CLVQTranscoder(8))  # an empty replica adds nothing
    assert tc.parts is None


def test_merge_averages_replicas_of_one_start():
    draw = cross_site(seed=4)
    start = fit(draw, 2, buffer_size=256)
    start.mark_shared_start()  # replicas start here: its statistics count once in a merge
    a, b = fit(draw, 0, buffer_size=256), fit(draw, 0, buffer_size=256)
    a.load_state_dict(start.state_dict())
    b.load_state_dict(start.state_dict())
    for _ in range(3):
        a.update(*draw(256)[:2])
        b.update(*draw(300)[:2])
    expected = [(p + q) / 2 for p, q in zip(a.parts.decoder.parameters(), b.parts.decoder.parameters())]
    steps, tokens = max(a.steps, b.steps), a.vq.tokens + b.vq.tokens - start.vq.tokens
    a.merge(b.state_dict())
    for p, e in zip(a.parts.decoder.parameters(), expected):
        torch.testing.assert_close(p.detach(), e)
    assert a.steps == steps and a.vq.tokens == tokens  # the shared start counted once
    other = fit(cross_site(seed=5), 2, buffer_size=256)  # another start: refused
    with pytest.raises(ValueError, match="one initialised state"):
        a.merge(other)


def test_codebook_counts_start_at_one_as_in_the_paper():
    tc = fit(cross_site(), 1, buffer_size=256)  # initialised on init_size rows, no EMA step yet
    assert torch.equal(tc.vq.fitted.counts, torch.ones(16))
    torch.testing.assert_close(tc.vq.fitted.sums, tc.vq.codes)  # smooth(1) = 1: sums = codes
    assert tc.concept_set().config["space"] == "clvq_z_e"


def test_merge_keeps_the_rows_either_side_holds_for_its_initialisation():
    src, tgt, _ = cross_site(seed=6)(400)
    make = lambda: CLVQTranscoder(16, hidden=32, batch_size=64, codebook=dict(init_size=256))  # noqa: E731
    a, b, alone = make(), make(), make()
    a.update(src[:100], tgt[:100])
    b.update(src[100:200], tgt[100:200])
    a.merge(b)  # both still waiting: a holds all 200 rows, as one fed both
    alone.update(src[:100], tgt[:100])
    alone.update(src[100:200], tgt[100:200])
    assert all(torch.equal(p, q) for p, q in zip(a.parts.pending, alone.parts.pending))
    a.update(src[200:300], tgt[200:300])
    alone.update(src[200:300], tgt[200:300])  # both initialise on the same 256 rows and step alike
    assert a.vq.is_initialised and torch.equal(a.vq.codes, alone.vq.codes) and a.steps == alone.steps
    waiting, fitted, twin = make(), make(), make()
    fitted.update(src[:300], tgt[:300])
    twin.load_state_dict(fitted.state_dict())
    waiting.update(src[300:400], tgt[300:400])
    waiting.merge(fitted)  # a copy of the fitted one, then its own 100 waiting rows
    twin.update(src[300:400], tgt[300:400])
    assert torch.equal(waiting.vq.codes, twin.vq.codes) and waiting.steps == twin.steps
    assert waiting.vq.tokens == twin.vq.tokens
    codes, steps = fitted.vq.codes.clone(), fitted.steps
    fitted.merge(make())  # an empty replica adds nothing
    assert torch.equal(fitted.vq.codes, codes) and fitted.steps == steps
