"""Buffers: a module's own buffers as a mutable dict, the way the SAE variants keep their
non-trainable tensors (`sae.buffer_dict["threshold"] = t` registers a buffer).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

from torch import Tensor, nn


class Buffers(MutableMapping[str, Tensor]):
    """A module's own buffers as a dict: setting a key registers a buffer, deleting one removes it."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def __getitem__(self, key: str) -> Tensor:
        value = self._module._buffers[key]
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key: str, value: Tensor) -> None:
        self._module.register_buffer(key, value)

    def __delitem__(self, key: str) -> None:
        del self._module._buffers[key]

    def __iter__(self) -> Iterator[str]:
        return iter([k for k, v in self._module._buffers.items() if v is not None])

    def __len__(self) -> int:
        return sum(v is not None for v in self._module._buffers.values())


def merge_warm_up(sae: Any, other: Any) -> None:
    """Before either SAE has trained (no parameters yet): take `other`'s per-site scales if it
    finished its warm-up, or pool the warm-up sums of squares if both are still warming up."""
    if sae.params or other.params or sae.scale is not None or other.d is None:
        return
    if other.scale is not None:
        sae.buffer_dict = {k: v.clone() for k, v in other.buffer_dict.items()}
    elif "warm_sq" in other.buffer_dict:
        sae.buffer_dict["warm_sq"] = other.buffer_dict["warm_sq"] + sae.buffer_dict.get("warm_sq", 0)
