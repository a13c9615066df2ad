"""How a stack's blocks hold the residual, against HF's hidden states: the stack's `BlockView`.

    view = block_view(blocks[0], trace, trace.hidden.get(prefix))   # BlockView(time_major=True) for FSMT
    as_hidden(trace.outputs[block], view, length)                   # that output as HF lists it

Found on block 0's input and applied by the hooks to every site of the stack:

- time-major: block 0 reads the `(T, B, d)` transpose of `hidden_states[0]` (FSMT, XLNet):
  readers and edits get the `(B, T, ...)` transpose, edits are transposed back. A projection that
  runs on the transpose of the block's rows (Longformer's attention) is time-major too
  (`transposed`); one whose rows are neither gets no q/k/v site.
- added positions "after": block 0 reads `hidden_states[0]` followed by more positions (Longformer
  and LED pad to their attention window; ProphetNet's decoder runs its n-gram streams after the
  main one): the site is the first T positions (T recorded by a pre-hook on the stack, the `Trim`
  view), the rest left as it is.
- added positions "before": positions the model prepends come first (CPM-Ant's prompt tokens,
  which HF cuts from its hidden states): the site is the last T.
- channels-first: `(B, C, T)` (SqueezeBERT's 1x1 convolutions): readers and edits get `(B, T, C)`
  (heads split after the transpose), edits go back contiguous.
- streams-first: the residual is `(n, B, T, d)`, n streams before the batch (Gemma 3n's AltUp,
  found where block 0's 4-D input equals `hidden_states[0]` with the probe's one row in dimension
  1): residual sites are its `(B, T, n, d)` permutation, a capture gives one `(n, d)` row per
  token; the sublayers run on one stream and stay `(B, T, d)`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from torch import Tensor, nn

from conceptlens.adapters.probe_pass import Trace, close

Added = Literal["none", "after", "before"]


@dataclass(frozen=True)
class BlockView:
    """How a stack's blocks hold the residual, against HF's `(B, T, d)` hidden states."""

    time_major: bool = False
    """`(T, B, d)`: the blocks run on the transpose (FSMT, XLNet)."""
    channels_first: bool = False
    """`(B, d, T)` (SqueezeBERT)."""
    streams_first: bool = False
    """`(n, B, T, d)`: n residual streams before the batch (Gemma 3n's AltUp)."""
    added: Added = "none"
    """Positions the model adds to the tokens: "after" them (the site is the first T) or "before"
    them (the last T)."""

    def transposed(self) -> BlockView:
        """This view with time-major toggled: a projection that runs on the transpose of the block's rows."""
        return replace(self, time_major=not self.time_major)


def as_hidden(x: Tensor | None, view: BlockView, length: int) -> Tensor | None:
    """A block tensor in HF's hidden-state layout: transposed (time-major or channels-first
    blocks) or cut to the stack's input `length` (blocks that run on positions the model adds)."""
    if x is None:
        return None
    if view.added == "before":
        return x[:, -length:]
    if view.added == "after":
        return x[:, :length]
    if view.channels_first:
        return x.transpose(1, 2)
    return x.transpose(0, 1) if view.time_major else x


def block_view(block: nn.Module, trace: Trace, hidden: tuple | None) -> BlockView:
    """The view of a stack whose block 0 is `block`, from its input in the probe and HF's
    `hidden[0]` (the plain `BlockView()` where they are equal or do not compare)."""
    x = trace.inputs.get(block)
    h = hidden[0] if hidden else None
    if x is not None and h is not None and x.ndim == h.ndim == 4 and x.shape[0] > 1 == x.shape[1] and close(x, h):
        return BlockView(streams_first=True)  # Gemma 3n's AltUp: (n, B, T, d), the probe's one row second
    if x is None or h is None or x.ndim != 3 or h.ndim != 3:
        return BlockView()
    if x.shape[0] != x.shape[1] and close(x.transpose(0, 1), h):
        return BlockView(time_major=True)
    if x.shape[1] != x.shape[2] and close(x.transpose(1, 2), h):
        return BlockView(channels_first=True)  # SqueezeBERT's (B, C, T) blocks
    if x.shape[0] == h.shape[0] and x.shape[1] > h.shape[1] and close(x[:, : h.shape[1]], h):
        return BlockView(added="after")
    if x.shape[0] == h.shape[0] and x.shape[1] > h.shape[1] and close(x[:, -h.shape[1]:], h):
        return BlockView(added="before")
    return BlockView()


def resid_shape(x0: Tensor, view: BlockView) -> tuple[str | int, ...]:
    """The residual sites' symbolic shape from block 0's input `x0` in HF's layout (`as_hidden`)."""
    if view.streams_first:  # (n, B, T, d) in the model: sites are its (B, T, n, d) permutation
        return ("B", "T", int(x0.shape[0]), int(x0.shape[-1]))
    if x0.ndim == 4 and x0.shape[0] == 1:  # (B, T, n, d) on the probe's one row (HY-V4)
        return ("B", "T", *(int(s) for s in x0.shape[2:]))
    return ("B", "T", int(x0.shape[-1]))
