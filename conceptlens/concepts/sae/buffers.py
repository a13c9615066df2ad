"""A module whose tensors read and write as dicts, the way the SAE variants keep them.

    sae.params = {"W_enc": w, ...}            # registers parameters
    sae.buffer_dict["threshold"] = t          # registers a buffer
    sae.to("cuda"); parent.load_state_dict(s) # through the whole state dict, extra state included
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any, Self

from torch import Tensor, nn

from conceptlens.concepts.base import map_tensors


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


class TensorModule(nn.Module):
    """An `nn.Module` whose parameters (`params`) and buffers (`buffer_dict`) are set as dicts and
    whose `state_dict()` holds all its state (tensors and `_extra_state`): moves, casts and a
    parent's `load_state_dict` go through it, so state beside the tensors moves with them."""

    @property
    def params(self) -> dict[str, Tensor]:
        """The trainable tensors (the module's parameters), by name."""
        return {k: p for k, p in self._parameters.items() if p is not None}

    @params.setter
    def params(self, values: dict[str, Tensor]) -> None:
        self._parameters.clear()
        for k, v in values.items():
            self.register_parameter(k, v if isinstance(v, nn.Parameter) else nn.Parameter(v))

    @property
    def buffer_dict(self) -> Buffers:
        """The non-trainable tensors (the module's buffers), as a mutable dict."""
        return Buffers(self)

    @buffer_dict.setter
    def buffer_dict(self, values: dict[str, Tensor]) -> None:
        self._buffers.clear()
        for k, v in values.items():
            self.register_buffer(k, v)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        """As a submodule of another module: this module's entries of the parent's state dict."""
        self.load_state_dict({k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)})

    def _apply(self, fn: Any, recurse: bool = True) -> Self:
        """`.cuda()`, `.cpu()`, `.to(...)` through nn.Module: every tensor of the state (an SAE's
        Adam moments and buffered rows included) goes where the parameters go."""
        self.load_state_dict(map_tensors(self.state_dict(), fn))
        return self


def merge_warm_up(sae: Any, other: Any) -> None:
    """Before either SAE has trained (no parameters yet): take `other`'s per-site scales if it
    finished its warm-up, or pool the warm-up sums of squares if both are still warming up."""
    if sae.params or other.params or sae.scale is not None or other.d is None:
        return
    if other.scale is not None:
        sae.buffer_dict = {k: v.clone() for k, v in other.buffer_dict.items()}
    elif "warm_sq" in other.buffer_dict:
        sae.buffer_dict["warm_sq"] = other.buffer_dict["warm_sq"] + sae.buffer_dict.get("warm_sq", 0)
