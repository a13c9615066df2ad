"""The SAE module holds the model; its SAETrainer holds what only training needs, as a typed state."""

import copy
from pathlib import Path

import pytest
import torch

from conceptlens.concepts.sae.persist import SAEState, TrainerState, WarmUp
from conceptlens.concepts.sae.trainer import SAETrainer, match_layouts
from tests.concepts.sae.data.old_states import CASES, CUT, feed, make, stream

V2 = Path(__file__).parent / "data" / "v2"
TRAINING = {"_opt", "_mixer", "_warm", "_tracker", "_running", "_gen"}
"""Where the module kept its training state before the trainer."""


def test_the_trainer_owns_the_training_state_and_the_module_the_model():
    sae = feed(make("topk"), stream("topk"))
    assert isinstance(sae.trainer, SAETrainer) and sae.trainer.sae is sae
    assert not TRAINING & vars(sae).keys()
    assert sae.trainer.optimiser().param_groups[0]["params"] == list(sae.parameters())
    assert sae.stats() == sae.trainer.stats() and sae.stats().steps > 0
    assert sae.trainer.warm.rows == 16 and sae.scale == pytest.approx((sae.d * 16 / sae.trainer.warm.sum_sq) ** 0.5)


@pytest.mark.parametrize("case", CASES)
def test_the_extra_state_is_an_sae_state_in_the_layout_main_wrote(case):
    """The keys of `_extra_state` are those of a checkpoint written before the trainer (v2), and
    `SAEState` reads them into the module's and the trainer's fields."""
    sae = feed(make(case), stream(case)[:CUT])
    extra = sae.state_dict()["_extra_state"]
    old = torch.load(V2 / f"{case}.pt", weights_only=True)["state"]["_extra_state"]
    assert extra.keys() == old.keys()
    saved = SAEState.from_dict(extra, sae.own_state)
    assert (saved.cls, saved.d, saved.scale, saved.parameters) == (type(sae).__name__, sae.d, sae.scale,
                                                                   [n for n, _ in sae.named_parameters()])
    assert isinstance(saved.trainer, TrainerState) and saved.trainer.warm == sae.trainer.warm
    assert saved.trainer.running == sae.trainer.running.state_dict()
    assert saved.to_dict().keys() == extra.keys()
    assert saved.own == {k: getattr(sae, k) for k in sae.own_state}


def test_a_trainer_state_is_a_copy_and_loads_into_a_fresh_trainer_bit_for_bit():
    chunks = stream("topk")
    whole = feed(make("topk"), chunks)
    first = feed(make("topk"), chunks[:CUT])
    tensors = {k: v.detach().clone() for k, v in first.state_dict().items() if k != "_extra_state"}
    state = first.trainer.state()
    feed(first, chunks[CUT:])  # the live trainer moves on; the state it gave does not
    again = make("topk")
    again.d, again.scale = whole.d, whole.scale
    again.params = {k: v.requires_grad_(True) for k, v in tensors.items()}
    again.trainer.load_state(state)
    feed(again, chunks[CUT:])
    for name, p in whole.named_parameters():
        assert torch.equal(p, again.get_parameter(name)), name
    assert again.stats() == whole.stats()


def test_a_warm_up_is_a_typed_value():
    assert WarmUp() == WarmUp(0.0, 0)
    state = make("topk").trainer.state()
    assert state.optimizer is None and state.warm == WarmUp() and state.to_dict()["warm"] == [0.0, 0]


@pytest.mark.parametrize("layout", ["autograd's", "contiguous"])  # contiguous: as ddp's all-reduced gradients
def test_the_fused_adam_step_equals_the_plain_adam_step_whatever_the_gradients_layout(layout):
    sae = feed(make("topk"), stream("topk")[:CUT])
    optimiser = sae.trainer.optimiser()
    assert optimiser.defaults["fused"]  # one kernel per step on CPU: 5x the plain loop at width 9216
    ours = optimiser.param_groups[0]["params"]
    assert not ours[0].is_contiguous()  # W_enc, stored transposed: the case a layout mix-up would break
    params = [p.detach().clone().requires_grad_() for p in ours]
    plain = torch.optim.Adam(params)
    plain.load_state_dict(copy.deepcopy(optimiser.state_dict()))  # its moments, step and lr (not shared)
    plain.param_groups[0]["fused"] = False
    g = torch.Generator().manual_seed(0)
    for p, q in zip(ours, params):
        grad = torch.randn(p.shape, generator=g)
        p.grad = grad if layout == "contiguous" else torch.empty_like(p).copy_(grad)
        q.grad = grad.clone()
        if layout == "contiguous":  # moments laid out otherwise too (a state from elsewhere)
            state = optimiser.state[p]
            state["exp_avg"], state["exp_avg_sq"] = state["exp_avg"].contiguous(), state["exp_avg_sq"].contiguous()
    match_layouts(optimiser)
    optimiser.step()
    plain.step()
    for p, q in zip(ours, params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
