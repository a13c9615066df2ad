"""Tiny random configs for every model type of transformers' LM auto mappings.

`tiny_config(model_type)` starts from the type's default config and shrinks every size field
generically (layers -> 2, widths -> 64, heads -> 4, ...), keeping them consistent; per-layer
lists (`layer_types`, ...) are cut to two entries that keep every kind present. A few types
need one extra key, listed in `_EXTRA` (test data, not library code).
"""

from __future__ import annotations

import transformers as tf
from transformers import CONFIG_MAPPING
from transformers.models.auto import modeling_auto as auto

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, POSITIONS = 64, 4, 2, 16, 128, 128, 128
LAYERS = 2

_SIZES = (
    (LAYERS, ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
             "num_decoder_layers", "num_encoder_layers", "num_hidden_groups", "num_self_attends_per_block")),
    (HIDDEN, ("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "word_embed_proj_dim", "embedding_size",
             "emb_dim", "n_embed", "attention_hidden_size", "audio_hidden_size", "lru_width", "pooler_hidden_size", "true_hidden_size",
             "intra_bottleneck_size", "embedding_dim", "input_embedding_size", "output_embedding_size", "d_latents")),
    (HEADS, ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
            "decoder_attention_heads", "swa_num_attention_heads", "num_encoder_attention_heads",
            "num_decoder_attention_heads")),
    (HEAD_DIM, ("head_dim", "d_kv", "attention_head_dim", "kv_channels", "d_head", "swa_head_dim",
               "attention_head_size", "v_head_dim", "dim_head", "qk_head_dim")),
    (FFN, ("intermediate_size", "d_ff", "n_inner", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "hidden_dim",
          "d_inner", "ffn_hidden_size", "dim_ff", "dff", "feed_forward_size", "shared_intermediate_size",
          "dense_intermediate_size", "intermediate_size_mlp")),
    (32, ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_ffn_hidden_size",
         "moe_shared_expert_intermediate_size", "shared_experts_intermediate_size", "q_lora_rank",
         "kv_lora_rank", "index_head_dim")),
    (8, ("qk_rope_head_dim", "qk_nope_head_dim", "mamba_d_state", "state_size", "ssm_state_size",
        "linear_key_head_dim", "linear_value_head_dim", "rotary_dim", "linear_head_dim")),
    (16, ("mamba_d_head", "mamba_head_dim", "mamba_headdim")),
    (128, ("mamba_d_ssm",)),  # heads (8) x head dim = the mixer's width (2 x 64)
    (4, ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", "index_n_heads")),
    (VOCAB, ("vocab_size", "src_vocab_size", "tgt_vocab_size", "decoder_vocab_size")),
    (POSITIONS, ("max_position_embeddings", "n_positions", "n_ctx", "max_encoder_position_embeddings",
                "max_decoder_position_embeddings", "max_source_positions", "max_target_positions")),
)
_SIZE_OF = {key: size for size, keys in _SIZES for key in keys}
_CAPS = {"num_key_value_heads": KV_HEADS, "num_kv_heads": KV_HEADS, "n_kv_heads": KV_HEADS,
         "swa_num_key_value_heads": KV_HEADS, "multi_query_group_num": KV_HEADS, "linear_num_key_heads": 2,
         "linear_num_value_heads": 4, "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2,
         "num_experts_per_token": 2, "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
         "n_group": 1, "topk_group": 1, "num_expert_group": 1, "first_k_dense_replace": 1, "num_dense_layers": 1,
         "sliding_window": 16, "window_size": 16, "sliding_window_size": 16, "attention_window_size": 16,
         "num_kv_shared_layers": 0, "index_topk": 16, "mamba_n_heads": 8, "mamba_n_groups": 1,
         "conv_kernel_size": 4, "max_window_layers": 1, "type_vocab_size": 2}

_KV_KEYS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_shared_experts", "num_experts_per_tok")

_DOTS3_TEXT = {"num_key_value_heads": HEADS, "per_layer_config": {"1": {
    "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "qk_nope_head_dim": 8, "head_dim": HEAD_DIM}}}

_GEMMA4_ASSISTANT = {"num_hidden_layers": LAYERS, "num_kv_shared_layers": LAYERS, "hidden_size_per_layer_input": 0,
                     "vocab_size_per_layer_input": 0, "enable_moe_block": False, "use_double_wide_mlp": False}

# Keys one model type needs on top of the generic shrinking.
_EXTRA: dict[str, dict] = {
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1, "expand": 2},
    "bamba": {"mamba_n_heads": 8, "mamba_d_head": 16},
    "reformer": {"axial_pos_shape": [8, 16], "axial_pos_embds_dim": [32, 32], "attn_layers": ["local", "lsh"],
                 "local_attn_chunk_length": 8, "lsh_attn_chunk_length": 8},
    # hybrids whose attention layers are placed by period / index: keep one of each kind in two layers
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "bamba": {"mamba_n_heads": 8, "mamba_d_head": 16, "attn_layer_indices": [1]},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "esmc": {"num_key_value_heads": HEADS},
    "esm": {"pad_token_id": 1, "mask_token_id": 2},
    "convbert": {"conv_kernel_size": 3},  # odd kernels keep the length
    # as many landmarks as segment positions: softmax attention on any length, as in the default config (64 / 64)
    "nystromformer": {"conv_kernel_size": 3, "num_landmarks": POSITIONS, "segment_means_seq_len": POSITIONS},
    "led": {"attention_window": [4, 4]},
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    "musicgen": {"decoder": {"num_codebooks": 1}},
    "musicgen_melody": {"decoder": {"num_codebooks": 1}},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM, "indexer_budget": 16,
                       "indexer_compress_ratio": 4},
    "qwen4_exp": {"text_config": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM,
                                  "indexer_budget": 16, "indexer_compress_ratio": 4}},
    "dory": {"n_input_layers": 0, "n_recurrent_layers": 2, "n_output_layers": 0},
    "albert": {"num_hidden_groups": 1},  # one shared layer run num_hidden_layers times, as in real ALBERT
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    # the shared transformer reads [hidden; embeddings] (2 x hidden) and is shared by at least two hybrid
    # layers (transformers ties them), so three layers: one Mamba, two hybrid calls of the shared block
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
              "attention_hidden_size": 2 * HIDDEN, "attention_head_dim": 2 * HIDDEN // HEADS},
    "zamba2": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
               "hybrid_layer_ids": [1, 2], "attention_hidden_size": 2 * HIDDEN, "attention_head_dim": 2 * HIDDEN // HEADS},
    # the sliding layers' override (layer 1) keeps as many k/v heads as query heads, head dim = nope + rope
    "dots3_note_text": _DOTS3_TEXT,
    "dots3_note": {"text_config": _DOTS3_TEXT, "vision_config": {"adapter_in_dim": HIDDEN, "adapter_out_dim": HIDDEN},
                   "audio_config": {"adapter_input_size": HIDDEN, "adapter_out_dim": HIDDEN}},
    # a draft model: its own defaults fail validation; it then needs the main model's shared k/v to run
    "gemma4_assistant": {"text_config": _GEMMA4_ASSISTANT},
    "gemma4_unified_assistant": {"text_config": _GEMMA4_ASSISTANT},
    "blt": {"encoder_config": {"hidden_size_global": HIDDEN}, "decoder_config": {"hidden_size_global": HIDDEN},
            "global_config": {"encoder_cross_output_size": HIDDEN}, "encoder_hash_byte_group_vocab": 1000},
}


def model_types() -> dict[str, str]:
    """Model type -> LM class name: seq2seq, else masked LM, else causal LM."""
    out: dict[str, str] = {}
    for mapping in (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
                    auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES):
        out.update(mapping)
    return dict(sorted(out.items()))


def _cut(values: list, n_layers: int) -> list:
    """Two entries of a per-layer list that keep each distinct kind if there are several."""
    if len(values) != n_layers or n_layers <= LAYERS:
        return values
    first = values[0]
    other = next((v for v in values if v != first), values[1])
    return [first, other] if values.index(other) > 0 else values[:LAYERS]


def _shrink(d: dict) -> dict:
    n_layers = next((d[k] for k in ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
                     if isinstance(d.get(k), int)), 0)
    vocab = VOCAB if "vocab_size" in d else None
    out = {}
    for key, value in d.items():
        if isinstance(value, dict) and (key.endswith("_config") or key in ("encoder", "decoder")) and \
                key != "per_layer_config":  # sub-configs (T5Gemma keeps its two under encoder / decoder)
            out[key] = _shrink(value)
        elif key == "per_layer_config" and isinstance(value, dict) and value:
            out[key] = _per_layer(value, d)
        elif value is None and key in _SIZE_OF:  # a size left to be derived, often never derived
            out[key] = _SIZE_OF[key]
        elif value is None and key in _KV_KEYS:
            out[key] = _CAPS[key]
        elif isinstance(value, bool) or value is None:
            out[key] = value
        elif isinstance(value, int) and key in _SIZE_OF:
            out[key] = _SIZE_OF[key]
        elif isinstance(value, int) and key in _CAPS:
            out[key] = min(value, _CAPS[key]) if value > 0 else value
        elif isinstance(value, list) and n_layers and len(value) == n_layers:
            out[key] = _cut(value, n_layers)
        elif vocab and key.endswith(("token_id", "token_index")) and isinstance(value, int) and value >= vocab:
            out[key] = vocab - 1 - (hash(key) % 8)
        elif vocab and key.endswith("token_id") and isinstance(value, list):
            out[key] = [v if v < vocab else vocab - 1 for v in value]
        else:
            out[key] = value
    return out


def _per_layer(overrides: dict, top: dict) -> dict:
    """Per-layer overrides keyed by layer index: the first override goes to the last of the two
    layers (where `_cut` keeps the second kind); a size it changes stays twice the tiny size."""
    key, value = next(iter(overrides.items()))
    small = _shrink(value)
    for name, v in value.items():
        if name in _SIZE_OF and isinstance(v, int) and v != top.get(name):
            small[name] = 2 * _SIZE_OF[name]
    for name in _KV_KEYS:  # as many k/v heads as query heads stays so
        if name in value and value[name] == value.get("num_attention_heads"):
            small[name] = small["num_attention_heads"]
    return {type(key)(LAYERS - 1) if isinstance(key, (int, str)) else LAYERS - 1: small}


def _merge(d: dict, extra: dict) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(d.get(key), dict):
            _merge(d[key], value)
        else:
            d[key] = value


def tiny_config(model_type: str):
    cls = CONFIG_MAPPING[model_type]
    try:
        d = cls().to_dict()
    except Exception:  # defaults that fail the type's own validation: start from the extra keys
        d = cls(**_EXTRA.get(model_type, {})).to_dict()
    for key in ("architectures", "transformers_version", "model_type", "_name_or_path", "dtype", "torch_dtype"):
        d.pop(key, None)
    d = _shrink(d)
    _merge(d, _EXTRA.get(model_type, {}))
    if isinstance(d.get("qk_rope_head_dim"), int) and "head_dim" in d:  # latent attention: rotary on its rope part
        d["head_dim"] = d["qk_rope_head_dim"]
    if isinstance(d.get("qk_rope_head_dim"), int) and "num_key_value_heads" in d:  # latent k/v: one per head
        d["num_key_value_heads"] = d.get("num_attention_heads", HEADS)
    return cls(**d)


def build(model_type: str, attn: str = "eager"):
    """A tiny random model of `model_type` with its LM head, in eval mode."""
    import torch

    cls = getattr(tf, model_types()[model_type])
    config = tiny_config(model_type)
    wanted = getattr(cls, "config_class", None)
    if isinstance(wanted, type) and not isinstance(config, wanted):  # an LM class of a multimodal type's text part
        config = config.get_text_config(decoder=True)
    torch.manual_seed(0)
    model = cls._from_config(config, attn_implementation=attn).eval()
    if hasattr(model, "set_default_language") and getattr(config, "languages", None):  # X-MOD's adapters
        model.set_default_language(config.languages[0])
    return model
