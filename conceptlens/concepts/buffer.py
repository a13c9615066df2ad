"""MixingBuffer: decorrelate tokens of the same document before minibatch steps.

    buf = MixingBuffer(size=16384, seed=0)
    for x in stream:                              # x: (N, d) activations, in document order
        buf.add(x)
        while (batch := buf.take(2048)) is not None:
            step(batch)                           # rows drawn at random from everything stored
    rest = buf.drain()                            # end of stream: what is left, shuffled

Consecutive tokens of one document are strongly correlated; a minibatch made of them is a
poor sample of the activation distribution. The buffer keeps at least `size` rows and hands
out uniformly random subsets, so each minibatch mixes many documents.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class MixingBuffer:
    """A token buffer that returns uniformly random rows once it holds `size` of them.

    Storage is one preallocated `(capacity, d)` tensor; `take` removes the drawn rows by
    moving unchosen rows from the tail into the holes (swap-remove, vectorised). The width
    d and dtype are set by the first `add`. All randomness comes from a private generator
    seeded with `seed`; `state_dict` holds the contents and the generator state.
    """

    def __init__(self, size: int, device: str | torch.device = "cpu", seed: int = 0) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int; got {size!r}")
        self.size = size
        self.device = torch.device(device)
        self.seed = seed
        self._gen = torch.Generator().manual_seed(seed)
        self._data: Tensor | None = None  # (capacity, d); rows [0, count) are live
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def add(self, x: Tensor) -> None:
        """Store the rows of `x` `(N, d)`."""
        if x.ndim != 2:
            raise ValueError(f"MixingBuffer.add expects (N, d); got shape {tuple(x.shape)}")
        if self._data is None:
            self._data = torch.empty(max(self.size, x.shape[0]), x.shape[1], dtype=x.dtype, device=self.device)
        elif x.shape[1] != self._data.shape[1]:
            raise ValueError(f"MixingBuffer holds rows of width {self._data.shape[1]}; got width {x.shape[1]}")
        need = self.count + x.shape[0]
        if need > self._data.shape[0]:
            # Grow geometrically so that a stream of adds costs amortised O(N).
            grown = self._data.new_empty(max(need, 2 * self._data.shape[0]), self._data.shape[1])
            grown[: self.count] = self._data[: self.count]
            self._data = grown
        self._data[self.count : need] = x.to(self._data.device, self._data.dtype)
        self.count = need

    def ready(self, n: int) -> int:
        """How many `take(n)` calls would return rows now."""
        need = max(self.size, n)
        return 0 if self.count < need else (self.count - need) // n + 1

    def take(self, n: int) -> Tensor | None:
        """`n` rows `(n, d)` drawn without replacement, or None until `size` (and n) rows are stored."""
        if n < 1:
            raise ValueError(f"take(n) needs n >= 1; got {n}")
        if self.count < max(self.size, n):
            return None
        return self._remove(torch.randperm(self.count, generator=self._gen)[:n])

    def drain(self) -> Tensor | None:
        """Everything left `(count, d)` in random order (None if empty); the buffer is then empty."""
        if self.count == 0:
            return None
        return self._remove(torch.randperm(self.count, generator=self._gen))

    def _remove(self, chosen: Tensor) -> Tensor:
        """Return rows `chosen` (indices into the live rows) and close the holes they leave."""
        assert self._data is not None
        chosen = chosen.to(self._data.device)
        out = self._data[chosen].clone()
        keep = self.count - chosen.shape[0]
        # Holes below `keep` are filled with the unchosen rows at or above `keep`; the two
        # sets have the same size, so after the copy rows [0, keep) are exactly the unchosen.
        taken = torch.zeros(self.count, dtype=torch.bool, device=self._data.device)
        taken[chosen] = True
        holes = chosen[chosen < keep].sort().values
        movers = keep + torch.nonzero(~taken[keep:]).flatten()
        self._data[holes] = self._data[movers]
        self.count = keep
        return out

    def state_dict(self) -> dict[str, Any]:
        data = None if self._data is None else self._data[: self.count].clone()
        return {"size": self.size, "seed": self.seed, "data": data, "generator": self._gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["size"] != self.size:
            raise ValueError(f"state is for a MixingBuffer of size {state['size']}; this one has size {self.size}")
        self._gen.set_state(state["generator"])
        self.count = 0
        self._data = None
        if state["data"] is not None:
            data = state["data"]
            self._data = torch.empty(max(self.size, data.shape[0]), data.shape[1], dtype=data.dtype, device=self.device)
            self._data[: data.shape[0]] = data.to(self.device)
            self.count = data.shape[0]
