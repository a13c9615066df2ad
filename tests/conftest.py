"""Shared fixtures: tiny random models of every supported family (no files, milliseconds)."""

from __future__ import annotations

import io
import os

import pytest
import torch
import transformers as tf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
tf.logging.set_verbosity_error()

_LLAMA_LIKE = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=99, max_position_embeddings=64)

CONFIGS = {
    "gpt2": lambda: tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=99, n_positions=64,
                                  bos_token_id=1, eos_token_id=2),
    "llama": lambda: tf.LlamaConfig(**_LLAMA_LIKE),
    "mistral": lambda: tf.MistralConfig(**_LLAMA_LIKE),
    "qwen2": lambda: tf.Qwen2Config(**_LLAMA_LIKE),
    "gemma2": lambda: tf.Gemma2Config(**_LLAMA_LIKE, head_dim=8),
    "gpt_neox": lambda: tf.GPTNeoXConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                         num_attention_heads=4, vocab_size=99, max_position_embeddings=64),
    "opt": lambda: tf.OPTConfig(num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=4,
                                vocab_size=99, word_embed_proj_dim=32, max_position_embeddings=64),
    "phi": lambda: tf.PhiConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                num_attention_heads=4, vocab_size=99, max_position_embeddings=64),
    "bert": lambda: tf.BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                  num_attention_heads=4, vocab_size=99, max_position_embeddings=64),
    "roberta": lambda: tf.RobertaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=4, vocab_size=99, max_position_embeddings=70),
    "distilbert": lambda: tf.DistilBertConfig(n_layers=2, dim=32, hidden_dim=64, n_heads=4, vocab_size=99,
                                              max_position_embeddings=64),
    "deberta-v2": lambda: tf.DebertaV2Config(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                             num_attention_heads=4, vocab_size=99, max_position_embeddings=64),
    "t5": lambda: tf.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=4, d_kv=8,
                              vocab_size=99, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1),
    "bart": lambda: tf.BartConfig(encoder_layers=2, decoder_layers=2, d_model=32, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, encoder_attention_heads=4, decoder_attention_heads=4,
                                  vocab_size=99, max_position_embeddings=64),
}
FAMILIES = list(CONFIGS)
ENCODERS = {"bert", "roberta", "distilbert", "deberta-v2"}
ENCODER_DECODERS = {"t5", "bart"}


def tiny_model(family: str, *, attn: str | None = None, seed: int = 0) -> torch.nn.Module:
    """A 2-block random model of `family` with its LM head, in eval mode."""
    config = CONFIGS[family]()
    if family in ENCODER_DECODERS:
        auto = tf.AutoModelForSeq2SeqLM
    elif family in ENCODERS:
        auto = tf.AutoModelForMaskedLM
    else:
        auto = tf.AutoModelForCausalLM
    torch.manual_seed(seed)
    kwargs = {"attn_implementation": attn} if attn else {}
    return auto.from_config(config, **kwargs).eval()


def tiny_inputs(family: str, batch: int = 3, length: int = 7, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random token ids with left padding on row 0 (2 pads) and, for encoder-decoders, decoder ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 99, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if family in ENCODER_DECODERS:
        inputs["decoder_input_ids"] = torch.randint(3, 99, (batch, length - 2), generator=g)
    return inputs


def hook_snapshot(model: torch.nn.Module) -> dict:
    """Every hook dictionary of every module, plus the attention-function registry."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    dicts = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
             "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_hooks")
    snap = {(name, d): dict(getattr(m, d)) for name, m in model.named_modules() for d in dicts}
    snap["attention_registry"] = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    snap["global_forward_hooks"] = dict(torch.nn.modules.module._global_forward_hooks)
    return snap


class Batches(list):
    """An `on_batch` that keeps every `(acts, meta)` a capture hands over during full forwards;
    `.acts` and `.meta` are the latest (capture-only forwards return them instead)."""

    def __call__(self, acts, meta) -> None:
        self.append((acts, meta))

    @property
    def acts(self) -> dict[str, torch.Tensor]:
        return self[-1][0]

    @property
    def meta(self):
        return self[-1][1]


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


class CharTokenizer:
    """A file-free tokenizer for tiny models: one id per character (ids 3-98), no specials."""

    all_special_ids: list[int] = []

    def __call__(self, texts, truncation=False, max_length=None, **kwargs):
        if isinstance(texts, str):
            texts = [texts]
        ids = [[3 + ord(c) % 96 for c in text] for text in texts]
        if truncation and max_length:
            ids = [row[:max_length] for row in ids]
        return {"input_ids": ids}


def roundtrip(state):
    """`state` through `torch.save` and a weights-only `torch.load`, as a checkpoint file carries it."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def assert_same_state(a, b, path: str = "state") -> None:
    """Exact equality of nested dicts / lists of tensors and scalars (a resumed state vs a whole run)."""
    assert type(a) is type(b), path
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_same_state(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{path}[{i}]")
    else:
        assert a == b or (a != a and b != b), path  # NaN statistics compare equal


def pytest_terminal_summary(terminalreporter):
    """After a run that included the coverage test: which comparisons ran for how many types."""
    from tests.adapters import coverage

    if coverage.LEDGERS:
        for line in coverage.summary():
            terminalreporter.write_line(line)
