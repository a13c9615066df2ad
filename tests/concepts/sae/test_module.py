"""An SAE is an nn.Module: parameters and buffers, state_dict, moves, nesting, DDP."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conceptlens.concepts.sae import BatchTopKSAE, TopKSAE
from tests.concepts.sae.data.old_states import feed, make, stream
from tests.conftest import assert_same_state, roundtrip


def _fitted(case="batchtopk"):
    return feed(make(case), stream(case))


def test_the_trained_tensors_are_parameters_and_buffers_of_the_module():
    sae = _fitted()
    assert isinstance(sae, nn.Module)
    assert [n for n, _ in sae.named_parameters()] == ["W_enc", "b_enc", "W_dec", "b_dec"]
    assert dict(sae.named_buffers()).keys() == {"threshold", "threshold_steps"}
    assert sae.trainer.optimizer.param_groups[0]["params"] == list(sae.parameters())  # Adam steps the module's own
    state = sae.state_dict()
    assert [k for k in state if k != "_extra_state"] == ["W_enc", "b_enc", "W_dec", "b_dec", "threshold",
                                                         "threshold_steps"]
    assert torch.equal(state["W_dec"], sae.W_dec)


def test_a_state_dict_round_trip_continues_bit_for_bit():
    chunks = stream("topk")
    whole = feed(make("topk"), chunks)
    first = feed(make("topk"), chunks[:4])
    again = make("topk")
    again.load_state_dict(roundtrip(first.state_dict()))
    feed(again, chunks[4:])
    assert_same_state(dict(whole.state_dict()), dict(again.state_dict()))


def test_forward_is_the_differentiable_reconstruction():
    sae = _fitted("topk")
    x = stream("topk")[0][0]
    x_hat = sae(x)
    torch.testing.assert_close(x_hat, sae.reconstruct(x))
    x_hat.pow(2).sum().backward()
    assert sae.W_dec.grad is not None and sae.W_dec.grad.abs().sum() > 0


def test_moves_and_nesting_keep_the_training_state():
    sae = _fitted("topk")
    before = sae.state_dict()
    assert sae.cpu() is sae and sae.to("cpu") is sae
    assert_same_state(dict(before), dict(sae.state_dict()))
    parent = nn.ModuleDict({"sae": sae})
    state = roundtrip(parent.state_dict())
    assert "sae.W_dec" in state and "sae._extra_state" in state
    fresh = nn.ModuleDict({"sae": make("topk")})
    fresh.load_state_dict(state)
    assert_same_state(dict(sae.state_dict()), dict(fresh["sae"].state_dict()))


def test_ddp_wraps_a_fitted_sae(tmp_path):
    sae = _fitted("topk")
    x = stream("topk")[0][0]
    expected = sae(x).detach()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = nn.parallel.DistributedDataParallel(sae)
        y = model(x)
        torch.testing.assert_close(y, expected, rtol=0, atol=0)  # the wrapped module's forward
        y.sub(x).pow(2).mean().backward()
        assert all(p.grad is not None for p in sae.parameters())
    finally:
        dist.destroy_process_group()


def test_an_unfitted_sae_has_no_parameters_and_says_so():
    sae = TopKSAE(width=8, k=2)
    assert list(sae.parameters()) == [] and list(sae.state_dict()) == ["_extra_state"]
    with pytest.raises(ValueError, match="has not taken a step yet"):
        sae(torch.randn(2, 4))
    assert isinstance(BatchTopKSAE(width=8, k=2), nn.Module)


def test_torch_compile_traces_the_forward():
    sae = _fitted("topk")
    x = stream("topk")[0][0]
    compiled = torch.compile(sae, backend="eager")  # dynamo's capture, without a C++ toolchain
    torch.testing.assert_close(compiled(x), sae(x), rtol=0, atol=0)


def test_a_cast_to_float64_computes_in_float64_and_round_trips_onto_a_fresh_module():
    sae = _fitted("topk")
    x = stream("topk")[0][0]
    expected = sae(x).detach().double()
    assert sae.to(torch.float64) is sae
    assert {p.dtype for p in sae.parameters()} == {torch.float64}
    assert {b.dtype for b in sae.buffers()} <= {torch.float64, torch.int64}
    y = sae(x.double())
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)  # float32 weights, now exact in float64
    fresh = make("topk")
    fresh.load_state_dict(roundtrip(sae.state_dict()))
    assert [p.dtype for p in fresh.parameters()] == [torch.float64] * 4
    assert_same_state(dict(sae.state_dict()), dict(fresh.state_dict()))
    torch.testing.assert_close(fresh(x.double()), y, rtol=0, atol=0)
