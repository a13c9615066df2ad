"""Stacks whose HF hidden states keep padding the model adds, and modules a block runs more than
once per call.

PEGASUS-X pads its encoder's tokens to a multiple of its block size inside the model; its hidden
states keep that padding, except the last, which is cut to the tokens before the final norm. The
sites are the tokens (the first T positions, the `trim` view): the probe compares them with the
first T positions of each hidden state, and `Adapter.padded_hidden` names the stacks where HF's
hidden states carry the padding. Its FFN and q/k/v projections run twice per layer call (on the
tokens, then on its global tokens): such a module's site is its first call in each call of the
block, kept only where that call runs on the block's rows. Its staggered layers run attention on
the rows padded by half a block on both sides: that sublayer's site starts `centre_offset` rows in
(the probe's sum check holds with exactly that cut).
"""

from __future__ import annotations

from torch import nn

from conceptlens.adapters.probe_pass import Trace, first_tensor


def trim_padded(hidden: tuple | None, length: int | None) -> tuple | None:
    """HF's hidden states cut to the stack's `length` input positions, where every one but the last
    is longer and the last has exactly that length (None: they are not padded)."""
    if not hidden or length is None:
        return None
    states = [s for h in hidden if (s := first_tensor(h)) is not None and s.ndim == 3]
    if len(states) != len(hidden) or states[-1].shape[1] != length or any(s.shape[1] <= length for s in states[:-1]):
        return None
    return tuple(s[:, :length] for s in states)


def cut_padded(trace: Trace) -> set[str]:
    """Stacks whose hidden states in the trace keep the model's padding; those are cut to the tokens."""
    found = set()
    for prefix, hidden in trace.hidden.items():
        if (cut := trim_padded(hidden, trace.lengths.get(prefix))) is not None:
            trace.hidden[prefix] = cut
            found.add(prefix)
    return found


def calls_per_block(module: nn.Module, block: nn.Module, trace: Trace) -> float:
    """How often `module` ran per call of the block it sits in, in the probe."""
    return trace.calls.get(module, 0) / max(trace.calls.get(block, 0), 1)


def first_call_rows_match(module: nn.Module, block: nn.Module, trace: Trace, point: str) -> bool:
    """The module's first call in the probe ran on the block's rows (B, T)."""
    x = trace.inputs.get(block)
    y = trace.inputs.get(module) if point == "input" else trace.outputs.get(module)
    return x is not None and y is not None and y.ndim == x.ndim and y.shape[:2] == x.shape[:2]


def centre_offset(out, x) -> int:
    """Rows a sublayer output has on each side beyond the block's own rows (both padded by the
    same amount; 0 when the rows match or do not look like that)."""
    if out is None or x is None or out.ndim != x.ndim or out.ndim < 3 or out.shape[0] != x.shape[0] or \
            out.shape[2:] != x.shape[2:] or out.shape[1] <= x.shape[1] or (out.shape[1] - x.shape[1]) % 2:
        return 0
    return (out.shape[1] - x.shape[1]) // 2


def repeated(module: nn.Module, block: nn.Module | None, trace: Trace, point: str) -> tuple[bool, bool]:
    """(the module runs more than once per call of `block`, its first call runs on the block's rows)."""
    if block is None or module is block or calls_per_block(module, block, trace) <= 1:
        return False, True
    return True, first_call_rows_match(module, block, trace, point)


def site_extras(module: nn.Module, point: str, channels_first: bool, direct: list[nn.Module], block: nn.Module | None,
                trace: Trace | None, row_offset: int = 0, own_rows: bool = True) -> dict | None:
    """The readings (adapters/readings.py's `Readings` fields) for the views of this module and the
    readings above; None where the site must be left out (a module the block runs more than
    once whose first call is not on the block's rows, or whose site is not on them: `own_rows`
    False, e.g. cross-attention keys of a projection shared with self-attention)."""
    fields: dict = {"channels_first": channels_first and point in ("input", "output")}
    if module in direct and point in ("input", "output"):
        fields["routed"] = module
    if trace is not None and point in ("input", "output"):
        again, rows = repeated(module, block, trace, point)
        if again and not ((rows and own_rows) or row_offset):
            return None
        if again:
            fields["first_call_in"] = block
    return fields
