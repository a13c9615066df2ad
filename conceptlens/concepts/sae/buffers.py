"""Buffers: a module's own buffers as a mutable dict, the way the SAE variants keep their
non-trainable tensors (`sae.buffer_dict["threshold"] = t` registers a buffer).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping

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
