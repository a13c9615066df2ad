"""Post-rotary queries and keys of chosen blocks, read at the `attn.q` / `attn.k` sites.

    capture = qk_capture(layers=[3, 10])       # (model, inputs) -> {layer: (q, k)}
    qk = capture(model, tok(texts, return_tensors="pt", padding=True))
    q, k = qk[10]                              # (N, H, d_head), (N, H_kv, d_head), padding dropped

This is the default `capture_qk` of `gauge_audit`: the same hooks the rest of conceptlens
reads q/k with (the attention-function wrapper of `conceptlens.hooks.attention`), so the
audit checks the tensors the library's metrics really see. One capture-only forward per
call, stopping after the deepest requested block; the model is left without hooks.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from torch import Tensor, nn

from conceptlens.adapters.adapter import Adapter, get_path
from conceptlens.hooks.capture import Capture
from conceptlens.hooks.manager import HookManager

QKCapture = Callable[[nn.Module, Mapping[str, Any]], Mapping[Any, tuple[Tensor, Tensor]]]
"""(model, inputs) -> {layer: (q, k)}: post-rotary q `(..., H, d_head)` and k `(..., H_kv, d_head)`,
either `(B, T, ...)` (gauge_audit drops padding with the attention mask) or `(N, ...)` rows."""


def qk_layers(adapter: Adapter, layers: Sequence[int] | None, stack: str = "") -> list[int]:
    """Block indices (negative ones count from the end) -> sorted non-negative indices."""
    if stack not in adapter.n_blocks:
        raise ValueError(f"stack must be one of {sorted(adapter.n_blocks)}; got {stack!r}")
    n = adapter.n_blocks[stack]
    if layers is None:
        return list(range(n))
    bad = [i for i in layers if not -n <= i < n]
    if bad or not layers:
        raise ValueError(f"layers {list(layers)} are not blocks of this model (0..{n - 1}, or -{n}..-1)")
    return sorted({i % n for i in layers})


def qk_capture(layers: Sequence[int] | None = None, *, stack: str = "") -> QKCapture:
    """A `capture_qk` for `gauge_audit` reading the `blocks.{i}.attn.q` / `.attn.k` sites.

        report = gauge_audit(model, inputs, capture_qk=qk_capture(layers=[0, 5]))

    `layers`: block indices (default all); `stack`: "" for single-stack models, "encoder" or
    "decoder" for encoder-decoders. Returns rows with padding dropped, keyed by block index.
    """

    def capture(model: nn.Module, inputs: Mapping[str, Any]) -> dict[int, tuple[Tensor, Tensor]]:
        hooks = HookManager(model)
        adapter = Adapter(model, hooks=hooks)
        base = getattr(model, "base_model", model)
        stacks = {name: get_path(base, path) for name, path in adapter.spec.stacks.items()}
        prefix = f"{stack}." if stack else ""
        chosen = qk_layers(adapter, layers, stack)
        names = {i: (f"{prefix}blocks.{i}.attn.q", f"{prefix}blocks.{i}.attn.k") for i in chosen}
        sites = [adapter.resolve(name) for pair in names.values() for name in pair]
        with hooks, Capture(hooks, sites, stacks) as cap:
            acts, _ = cap.forward(**inputs)
        return {i: (acts[q], acts[k]) for i, (q, k) in names.items()}

    return capture
