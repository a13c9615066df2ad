"""Capture: stream the activations of chosen sites, one call per forward.

    def on_batch(acts, meta):                 # acts: site -> (N, d) float32, rows aligned
        km.update(acts["blocks.3.resid_out"])
    with lens.capture(["blocks.3.resid_out"], on_batch=on_batch) as cap:
        model(**batch)                        # full forward; on_batch runs once at its end
        acts, meta = cap.forward(**batch)     # capture-only: stops after the last site needed

Padding is dropped (and special tokens, if asked) so every site gives the same rows in the
same order. Hooks live only inside the `with`; any error while registering, inside the
block or inside `on_batch` leaves the model without them.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from conceptlens.hooks.handles import HandleGroup
from conceptlens.hooks.manager import HookManager
from conceptlens.hooks.points import hook_site
from conceptlens.hooks.tokens import TokenMeta, TokenTracker
from conceptlens.sites.site import Site

OnBatch = Callable[[dict[str, Tensor], TokenMeta], Any]
Captured = tuple[dict[str, Tensor], TokenMeta]
"""One forward's capture: site name -> rows (or (B, T, ...) tensors with keep_shape), and their bookkeeping."""


def _run_order(stack: str) -> int:
    """Stacks run in this order: "" and "encoder" first, then "decoder"."""
    return int(stack == "decoder")


class StopForward(Exception):
    """Raised inside a capture-only forward once every requested site has been read."""


def run_stack(site: Site) -> str:
    """The stack whose forward produces the site (cross-attention keys live in the decoder)."""
    head = site.name.split(".", 1)[0]
    return head if head in ("encoder", "decoder") else ""


class Capture:
    """Context manager that reads sites during forwards; see the module docstring."""

    def __init__(self, hooks: HookManager, sites: Sequence[Site], stacks: dict[str, nn.Module],
                 on_batch: OnBatch | None = None, *, keep_shape: bool = False,
                 special_ids: Tensor | None = None, dtype: torch.dtype | str = torch.float32) -> None:
        if not sites:
            raise ValueError("capture needs at least one site")
        if not (isinstance(dtype, torch.dtype) or dtype == "model"):
            raise ValueError(f"capture dtype must be a torch.dtype or 'model' (keep the model's); got {dtype!r}")
        self.sites = {site.name: site for site in sites}
        token_stacks = {site.stack for site in sites}
        run_stacks = {run_stack(site) for site in sites}
        if not keep_shape and (len(token_stacks) > 1 or len(run_stacks) > 1):
            raise ValueError(f"sites {list(self.sites)} come from different token streams "
                             f"({sorted(token_stacks | run_stacks)}), so their rows cannot be aligned; "
                             "capture them in separate captures or with keep_shape=True")
        # Encoder before decoder: acts are reset when the first stack starts and handed over
        # when the last one ends, so a keep_shape capture across both keeps both.
        order = sorted(run_stacks, key=_run_order)
        self.start_stack, self.stack_name = order[0], order[-1]
        self.token_stack = max(token_stacks, key=_run_order)
        self.hooks = hooks
        self.model = hooks.model
        self.stacks = stacks
        self.on_batch = on_batch
        self.keep_shape = keep_shape
        self.dtype = None if dtype == "model" else dtype  # None: each site's own dtype
        self._captured: Captured | None = None  # the latest flush, for forward() to return
        self.tokens = TokenTracker(stacks, special_ids, on_start=self._on_stack_start)
        self._acts: dict[str, Tensor] = {}
        self._shapes: dict[str, tuple[int, int]] = {}  # token stack -> (B, T) read this forward
        self._stopping = False
        self._handles: HandleGroup | None = None

    # -- registration -------------------------------------------------------------------
    def __enter__(self) -> Capture:
        if self._handles is not None:
            raise RuntimeError("this Capture is already active; create a new one to nest captures")
        handles = HandleGroup()
        try:
            self.tokens.register(self.hooks, handles)
            handles.add(self.hooks.forward_hook(self.stacks[self.stack_name], self._stack_post_hook))
            for site in self.sites.values():
                handles.add(hook_site(self.hooks, site, self._reader(site)))
        except BaseException:
            handles.remove()
            raise
        self._handles = handles
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove every hook of this capture (safe to call twice)."""
        handles, self._handles = self._handles, None
        self._acts = {}
        self.tokens.clear()
        if handles is not None:
            handles.remove()

    # -- hooks ----------------------------------------------------------------------------
    def _on_stack_start(self, name: str) -> None:
        if name == self.start_stack and self.hooks.reads(self):
            self._acts, self._shapes = {}, {}

    def _stack_post_hook(self, module, args, output) -> None:
        if self.hooks.reads(self):  # (another capture's private forward: not this capture's rows)
            self._flush()

    def _reader(self, site: Site):
        name, stack = site.name, site.stack

        def read(x: Tensor) -> None:
            if not self.hooks.reads(self):
                return
            x = x.detach()
            self._shapes[stack] = (x.shape[0], x.shape[1])
            if self.keep_shape:
                self._acts[name] = x.to(self.dtype or x.dtype, copy=True)
            else:
                keep = self.tokens.meta(stack, x.shape[0], x.shape[1], x.device).keep
                self._acts[name] = x[keep].to(self.dtype or x.dtype)  # boolean indexing copies
            if self._stopping and len(self._acts) == len(self.sites):
                raise StopForward

        return read

    def _flush(self) -> None:
        acts, self._acts = self._acts, {}
        if not acts:
            return
        device = next(iter(acts.values())).device
        stack = self.token_stack if self.token_stack in self._shapes else next(iter(self._shapes))
        meta = self.tokens.meta(stack, *self._shapes[stack], device)
        if not self.keep_shape:
            keep = meta.keep
            meta = TokenMeta(meta.row[keep], meta.position[keep], meta.token[keep], keep)
        if self._stopping:  # inside forward(), which returns them; full forwards keep nothing
            self._captured = (acts, meta)
        if self.on_batch is not None:
            self.on_batch(acts, meta)

    # -- capture-only forward -------------------------------------------------------------
    @torch.no_grad()
    def forward(self, *args: Any, **kwargs: Any) -> Captured:
        """Run the model only as far as the last requested site; return `(acts, meta)` as
        `on_batch` gets them (which also runs)."""
        if self._handles is None:
            raise RuntimeError("Capture.forward must be called inside `with lens.capture(...)`")
        self._stopping, self._captured = True, None
        try:
            self.model(*args, **kwargs)
        except StopForward:
            self._flush()
        finally:
            self._stopping = False
        captured, self._captured = self._captured, None
        if captured is None:
            raise RuntimeError(f"the forward reached none of the sites {list(self.sites)}")
        return captured
