"""Where a model's inputs go, for models on one device or spread by an accelerate device map.

    device = input_device(model)             # cuda:0 for device_map={"model.embed_tokens": 0, ...}
    batch = {k: v.to(device) for k, v in batch.items()}

A model loaded with `device_map=` (accelerate) keeps some weights on other GPUs, on the CPU
or on disk (those parameters sit on the `meta` device until their module runs). Hooks read
and edit each site's tensor on the device it lives on; only the inputs need one device, the
one of the input embeddings.
"""

from __future__ import annotations

import torch
from torch import nn


def _as_device(where: int | str | torch.device) -> torch.device:
    if isinstance(where, int):
        return torch.device("cuda", where)
    if where in ("disk", "meta"):  # offloaded weights are brought to the CPU when they run
        return torch.device("cpu")
    return torch.device(where)


def input_device(model: nn.Module) -> torch.device:
    """The device a model's `input_ids` should be on before its forward."""
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        get_embeddings = getattr(model, "get_input_embeddings", None)  # a transformers model's
        embed = get_embeddings() if callable(get_embeddings) else None
        names = {module: name for name, module in model.named_modules()}
        name = names.get(embed, "")
        # the longest device-map entry that contains the embedding (or "" for the whole model)
        owners = [key for key in device_map if key == "" or name == key or name.startswith(key + ".")]
        if owners:
            return _as_device(device_map[max(owners, key=len)])
        return _as_device(next(iter(device_map.values())))
    for param in model.parameters():
        if param.device.type != "meta":
            return param.device
    return torch.device("cpu")
