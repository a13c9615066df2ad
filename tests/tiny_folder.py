"""A tiny random Llama saved as a local model folder (config, weights, byte-level tokenizer)."""

from __future__ import annotations

from pathlib import Path

import torch


def save_tiny_llama(folder: Path) -> Path:
    """A 2-block random Llama with a byte-level BPE tokenizer, saved as a local model folder."""
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(["<s>", "</s>", *sorted(alphabet)])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    tok.save_pretrained(folder)
    config = tf.LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    return folder
