"""Reversible (two-stream) blocks: a sublayer that adds to the block's other residual stream.

A RevNet block (Reformer) carries two streams: `Y1 = X1 + attn(X2)`, `Y2 = X2 + ffn(Y1)`. Its
call reads X2 as `hidden_states` and X1 as another argument, and returns (Y2, Y1, ...); HF's
hidden states are the X2 stream, so `resid_in` / `resid_out` are X2 / Y2 and the plain sum
`resid_in + attn_out + mlp_out == resid_out` cannot hold: the attention adds to the other
stream. Detected on the probe and verified there at the sum check's tolerance (1e-4): for some
split of the sublayers, `resid_in + (this stream's sublayers) == resid_out` and `X1 + (the
others) == Y1`, X1 a tensor argument of the block and Y1 an element of its output, both of the
residual's shape. The sublayer sites stay what the sublayer returns (exact, edited at its own
output); their descriptions and `BlockLayout.other_stream` state the equation. A namedtuple
output is rebuilt with its type; the coverage test sums only this stream's sublayers. Reformer
pads inputs longer than its smallest chunk to its chunk length inside the model, and its hidden
states (and so its sites, with `keep_shape=True`) keep those positions; the token bookkeeping
marks every position past the stack's `input_ids` as no token (id -1), so captures and fits get
one row per real token and position selectors never count the padding.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from conceptlens.adapters.probe_pass import Trace, close
from conceptlens.adapters.structure import BlockLayout


def other_stream(block: nn.Module, lay: BlockLayout, outs: dict[str, torch.Tensor], trace: Trace) -> bool:
    """Find and verify the split (sets `lay.other_stream` and the notes); False if none holds.
    `outs`: each sublayer site's probe output (float, residual-shaped)."""
    x, y = trace.inputs.get(block), trace.outputs.get(block)
    if x is None or y is None or block not in trace.streams or len(outs) < 2:
        return False
    x, y = x.float(), y.float()
    args, results = trace.streams[block]
    first = "args[0]" if "args[0]" in args else "hidden_states"  # the argument resid_in reads (probe_pass.py)
    ins = {n: t.float() for n, t in args.items() if n != first and t.shape == x.shape and t.is_floating_point()}
    res = {i: t.float() for i, t in enumerate(results) if i and t is not None and t.shape == y.shape
           and t.is_floating_point()}
    kinds = list(outs)
    for size in range(1, len(kinds)):
        for other in itertools.combinations(kinds, size):
            mine = [k for k in kinds if k not in other]
            if not close(x + sum(outs[k] for k in mine), y, 1e-4):
                continue
            delta = sum(outs[k] for k in other)
            pair = next(((n, i) for n, a in ins.items() for i, b in res.items() if close(a + delta, b, 1e-4)), None)
            if pair is None:
                continue
            lay.other_stream = tuple(other)
            lay.style += f", reversible two-stream: resid_in / resid_out are its {first} stream (HF's hidden " \
                         f"states), the other is its argument {pair[0]} -> output[{pair[1]}]"
            for k in other:
                lay.notes[k] = (f"adds to the block's other residual stream (its argument {pair[0]} -> "
                                f"output[{pair[1]}]; a reversible block), not to resid_in / resid_out, which are "
                                f"HF's hidden states: resid_out = resid_in + {' + '.join(mine)}")
            for k in mine:
                lay.notes[k] = "what it adds to the residual (resid_in -> resid_out) of this reversible block"
            return True
    return False
