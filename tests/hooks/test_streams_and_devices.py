"""keep_shape captures across encoder and decoder keep both; token metadata follows the device."""

from __future__ import annotations

import torch

import conceptlens
from conceptlens.hooks.tokens import StackInputs, TokenTracker
from tests.conftest import Batches, tiny_inputs, tiny_model


def test_keep_shape_capture_across_encoder_and_decoder_keeps_both():
    model = tiny_model("t5")
    lens = conceptlens.attach(model)
    inputs = tiny_inputs("t5")
    names = ["encoder.blocks.0.resid_out", "decoder.blocks.0.resid_out", "decoder.blocks.1.attn.q",
             "encoder.blocks.1.attn.k"]
    with torch.no_grad():
        ref = model(**inputs, output_hidden_states=True)
        for order in (names, names[::-1]):
            seen = Batches()
            with lens.capture(order, keep_shape=True, on_batch=seen):
                model(**inputs)
            acts, meta = seen[-1]
            assert set(acts) == set(names)
            assert torch.equal(acts["encoder.blocks.0.resid_out"], ref.encoder_hidden_states[1])
            assert torch.equal(acts["decoder.blocks.0.resid_out"], ref.decoder_hidden_states[1])
            assert meta.keep.shape == inputs["decoder_input_ids"].shape  # the decoder's (last stack's) tokens


def test_token_metadata_is_cached_per_device():
    tracker = TokenTracker({})
    ids = torch.tensor([[5, 6, 7]])
    tracker.inputs[""] = StackInputs(ids, torch.ones_like(ids))
    cpu = tracker.meta("", 1, 3, torch.device("cpu"))
    other = tracker.meta("", 1, 3, torch.device("meta"))  # a second device of a device_map model
    assert cpu.keep.device.type == "cpu"
    assert other.keep.device.type == "meta" and other.position.device.type == "meta"
    assert tracker.meta("", 1, 3, torch.device("cpu")) is cpu
