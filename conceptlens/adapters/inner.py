"""Sublayer contributions that are one call of a module inside the sublayer.

A post-LN sublayer that adds and norms the residual inside itself (XLNet's relative attention:
`layer_norm(dropout(einsum(attn_vec, o)) + h)`) may compute what it adds with a bare parameter,
so no projection module returns it. What it adds is then still the output of some module call
inside it, when sublayer input + that output is exactly the norm's input: XLNet's `dropout`,
whose first call drops attention probabilities and whose second returns the projected heads.
The site hooks that module during that call of each forward of the sublayer (`Site.call`,
counted as for a shared layer's calls, `hooks/calls.py`), so reads and edits are the tensor the
model adds, bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from conceptlens.adapters.probe_pass import Trace


def inner_call(sublayer: nn.Module, norm: nn.Module, trace: Trace) -> tuple[str, int] | None:
    """(path inside `sublayer`, call index from 0) of the module call whose output plus the
    sublayer's input is exactly the input of `norm` (inside the sublayer); None if none is."""
    x, target = trace.inputs.get(sublayer), trace.inputs.get(norm)
    if x is None or target is None or target.shape != x.shape:
        return None
    for path, module in sublayer.named_modules():
        if not path or module is norm or any(True for _ in module.children()):
            continue
        for k in range(trace.calls.get(module, 0)):
            out = trace.outputs.get(module) if k == 0 else trace.later.get((module, k), (None, None))[1]
            if out is not None and out.shape == x.shape and torch.equal(x + out, target):
                return path, k
    return None
