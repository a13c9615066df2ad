import pytest
import torch

from conceptlens.concepts.buffer import MixingBuffer


def rows(start: int, n: int, d: int = 3) -> torch.Tensor:
    """Rows whose first column is a unique id, so taken rows can be traced back."""
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(start))
    x[:, 0] = torch.arange(start, start + n, dtype=torch.float32)
    return x


def test_take_waits_for_size_then_returns_distinct_stored_rows():
    buf = MixingBuffer(10, seed=0)
    buf.add(rows(0, 6))
    assert buf.take(4) is None
    buf.add(rows(6, 6))
    out = buf.take(4)
    assert out.shape == (4, 3) and len(buf) == 8
    ids = out[:, 0].long()
    assert len(set(ids.tolist())) == 4 and all(0 <= i < 12 for i in ids.tolist())
    assert buf.take(4) is None  # 8 < size


def test_every_row_comes_out_exactly_once_and_unchanged():
    buf = MixingBuffer(16, seed=3)
    x = rows(0, 200)
    out = []
    for chunk in x.split(13):  # adds larger than what is taken make the storage grow
        buf.add(chunk)
        while (batch := buf.take(5)) is not None:
            out.append(batch)
    out.append(buf.drain())
    assert buf.drain() is None and len(buf) == 0
    out = torch.cat(out)
    order = out[:, 0].long()
    assert sorted(order.tolist()) == list(range(200))
    assert torch.equal(out, x[order])
    assert not torch.equal(order, torch.arange(200))  # mixed, not first-in first-out


def test_draws_are_uniform_over_stored_rows():
    trials, counts = 3000, torch.zeros(10)
    for seed in range(trials):
        buf = MixingBuffer(10, seed=seed)
        buf.add(rows(0, 10))
        counts[buf.take(3)[:, 0].long()] += 1
    freq = counts / trials
    # Each row is chosen with probability 3/10; binomial sd is 0.0084 per row.
    assert torch.allclose(freq, torch.full((10,), 0.3), atol=0.04), freq


def test_state_dict_resumes_bit_identically():
    def run(buf, chunks):
        out = []
        for chunk in chunks:
            buf.add(chunk)
            while (batch := buf.take(4)) is not None:
                out.append(batch)
        return out

    chunks = [rows(10 * i, 7) for i in range(8)]
    whole = MixingBuffer(12, seed=1)
    expected = run(whole, chunks) + [whole.drain()]
    first = MixingBuffer(12, seed=1)
    got = run(first, chunks[:3])
    state = first.state_dict()
    second = MixingBuffer(12, seed=1)
    second.load_state_dict(state)
    got += run(second, chunks[3:]) + [second.drain()]
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


def test_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="size"):
        MixingBuffer(0)
    buf = MixingBuffer(4)
    buf.add(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="width 3"):
        buf.add(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="n >= 1"):
        buf.take(0)
    with pytest.raises(ValueError, match="size 4"):
        MixingBuffer(5).load_state_dict(buf.state_dict())


def test_buffer_lives_on_the_device_of_its_first_rows():
    buf = MixingBuffer(size=4, seed=0)
    buf.add(torch.zeros(6, 3, device="meta"))  # a stand-in for a GPU: no copy back to the host
    out = buf.take(2)
    assert buf.device.type == "meta" and out.device.type == "meta" and out.shape == (2, 3) and len(buf) == 4
    assert MixingBuffer(size=4, device="cpu").device == torch.device("cpu")
