"""Models spread by an accelerate device map (CPU and disk offload) and models in other dtypes."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import conceptlens
from conceptlens.concepts.kmeans import StreamingKMeans
from conceptlens.devices import input_device
from conceptlens.steering.edits import Add, ProjectOut
from tests.conftest import Batches, CharTokenizer, assert_same_state, hook_snapshot, tiny_inputs, tiny_model

SITES = ["embed", "blocks.0.resid_out", "blocks.1.attn.k", "blocks.1.mlp_out", "blocks.1.resid_out", "final"]
DOCS = [f"document {i} " + "abc" * (i % 5) for i in range(24)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The same tiny Llama twice: in memory, and loaded with block 1, the norm and the head on disk."""
    folder = tmp_path_factory.mktemp("llama")
    model = tiny_model("llama")
    model.save_pretrained(folder)
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.norm": "disk", "lm_head": "disk"}
    offloaded = tf.AutoModelForCausalLM.from_pretrained(folder, device_map=device_map,
                                                        offload_folder=str(folder / "offload")).eval()
    assert next(offloaded.model.layers[1].parameters()).device.type == "meta"  # really on disk
    return model, offloaded


def test_capture_through_disk_offload_equals_capture_without(pair):
    inputs = tiny_inputs("llama")
    got = []
    for model in pair:
        lens = conceptlens.attach(model)
        seen = Batches()
        with lens.capture(SITES, on_batch=seen) as cap:
            full = model(**inputs).logits
            acts_full, meta_full = seen.acts, seen.meta
            acts, meta = cap.forward(**inputs)  # stops after the last site
        for name in SITES:
            assert torch.equal(acts[name], acts_full[name])
        assert all(torch.equal(x, y) for x, y in zip(meta, meta_full))
        got.append((acts, meta, full))
    (a, meta_a, logits_a), (b, meta_b, logits_b) = got
    for name in SITES:
        assert torch.equal(a[name], b[name]), name
    assert all(torch.equal(x, y) for x, y in zip(meta_a, meta_b))
    assert torch.equal(logits_a, logits_b)


def test_steering_through_disk_offload_equals_steering_without(pair):
    inputs = tiny_inputs("llama")
    g = torch.Generator().manual_seed(0)
    direction = torch.randn(3, 32, generator=g)
    outs = []
    for model in pair:
        lens = conceptlens.attach(model)
        before = hook_snapshot(model)
        with torch.no_grad(), lens.steer(Add(direction[0], alpha=3.0, site="blocks.1.resid_out"),
                                         ProjectOut(direction[1:], site="blocks.0.mlp_out"), positions=slice(3, None)):
            outs.append(model(**inputs).logits)
        assert hook_snapshot(model) == before
    assert torch.equal(outs[0], outs[1])
    with torch.no_grad():
        assert not torch.equal(outs[1], pair[1](**inputs).logits)  # the edit did something


def test_fit_through_disk_offload_equals_fit_without(pair):
    states = []
    for model in pair:
        km = StreamingKMeans(n_concepts=4, init_size=32, seed=0)
        lens = conceptlens.attach(model, CharTokenizer())
        report = lens.fit({"blocks.1.resid_out": km}, DOCS, batch_size=8, max_length=16, progress=False)
        states.append((km.state_dict(), report.rows))
    assert_same_state(states[0][0], states[1][0])
    assert states[0][1] == states[1][1]


def test_input_device_follows_the_device_map(pair):
    model, offloaded = pair
    assert input_device(model) == torch.device("cpu") == input_device(offloaded)
    offloaded.hf_device_map = {**offloaded.hf_device_map, "model.embed_tokens": 0}
    try:
        assert input_device(offloaded) == torch.device("cuda", 0)
    finally:
        offloaded.hf_device_map["model.embed_tokens"] = "cpu"


def test_robust_norm_steering_and_sweeps_with_the_embeddings_on_disk(tmp_path):
    """The first parameter is on `meta` when the embeddings are offloaded: inputs go to the
    embeddings' execution device, never to `meta`."""
    from conceptlens.steering import robust_norm, sweep, token_logprob
    from tests.steering.test_sweep import PROMPTS, word_tokenizer

    model, tok = tiny_model("llama"), word_tokenizer()
    model.save_pretrained(tmp_path)
    device_map = {"model.embed_tokens": "disk", "model.rotary_emb": "cpu", "model.layers": "cpu",
                  "model.norm": "cpu", "lm_head": "cpu"}
    offloaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path, device_map=device_map,
                                                        offload_folder=str(tmp_path / "offload")).eval()
    assert next(offloaded.parameters()).device.type == "meta"
    results = []
    for m in (model, offloaded):
        m.generation_config.eos_token_id = 1
        lens = conceptlens.attach(m, tok)
        direction = model.get_output_embeddings().weight[50].detach()
        result = sweep(lens, lambda a: Add(direction, a, scale="robust_norm", site="blocks.1.resid_out"), [0, 4],
                       PROMPTS, token_logprob(tok, "w50"), max_new_tokens=3)
        results.append((robust_norm(lens, "blocks.1.resid_out"), result.texts, result.perplexity))
    assert results[0][0] == results[1][0] and results[0][1] == results[1][1]
    torch.testing.assert_close(results[0][2], results[1][2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_capture_in_the_models_dtype_on_request(dtype):
    model = tiny_model("llama").to(dtype)
    inputs = tiny_inputs("llama")
    lens = conceptlens.attach(model)
    with torch.no_grad():
        hidden = model(**inputs, output_hidden_states=True).hidden_states
    keep = inputs["attention_mask"].bool()
    with lens.capture(["blocks.0.resid_out", "blocks.1.attn.q"], dtype="model") as cap:
        own, _ = cap.forward(**inputs)
    with lens.capture(["blocks.0.resid_out"]) as cap:
        default, _ = cap.forward(**inputs)
    assert own["blocks.0.resid_out"].dtype == dtype and own["blocks.1.attn.q"].dtype == dtype
    assert torch.equal(own["blocks.0.resid_out"], hidden[1][keep])
    assert default["blocks.0.resid_out"].dtype == torch.float32  # float32 stays the default
    assert torch.equal(default["blocks.0.resid_out"], hidden[1][keep].float())


def test_fit_feeds_bf16_rows_on_request():
    model = tiny_model("llama").to(torch.bfloat16)
    seen = []

    class Recorder:
        def update(self, x):
            seen.append(x.dtype)

        def state_dict(self):
            return {}

    conceptlens.attach(model, CharTokenizer()).fit({"blocks.0.resid_out": Recorder()}, DOCS[:8], max_length=8,
                                                   progress=False, dtype="model")
    assert seen and set(seen) == {torch.bfloat16}


def test_bad_capture_dtype_names_the_choices():
    lens = conceptlens.attach(tiny_model("llama"))
    with pytest.raises(ValueError, match="torch.dtype or 'model'.*'bf16'"):
        lens.capture("blocks.0.resid_out", dtype="bf16")
