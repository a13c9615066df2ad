"""What a user needs to know about one layer's attention: sliding window or global, rotary base."""

from __future__ import annotations

from torch import nn


def _rope_theta(config, layer_type: str | None) -> float | None:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):
        if layer_type and isinstance(params.get(layer_type), dict):
            params = params[layer_type]
        theta = params.get("rope_theta")
        if theta is not None:
            return float(theta)
    theta = getattr(config, "rope_theta", None)
    return float(theta) if isinstance(theta, (int, float)) else None


def attention_notes(config, layer: int, attn: nn.Module | None) -> str:
    """e.g. "sliding-window attention (window 4096); rotary base 10000" ("" if nothing to say)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None)
    layer_type = types[layer] if isinstance(types, (list, tuple)) and layer < len(types) else None
    window = getattr(attn, "sliding_window", None) if attn is not None else None
    parts = []
    if isinstance(window, int) and window > 0:
        parts.append(f"sliding-window attention (window {window})")
    elif layer_type == "sliding_attention" and getattr(text, "sliding_window", None):
        parts.append(f"sliding-window attention (window {text.sliding_window})")
    elif layer_type in ("full_attention", None) and (types or getattr(text, "sliding_window", None)):
        parts.append("global attention")
    rope_type = getattr(attn, "rope_layer_type", None)  # DeepSeek V4: which of the config's ropes the layer uses
    theta = _rope_theta(text, rope_type if isinstance(rope_type, str) else layer_type)
    if theta is not None and attn is not None:
        parts.append(f"rotary base {theta:g}")
    return "; ".join(parts)
