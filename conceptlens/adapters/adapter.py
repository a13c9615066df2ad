"""Adapter: the table of sites of one model, built from its own modules.

    adapter = Adapter(model)
    adapter.sites["blocks.3.resid_out"]     # Site bound to model.model.layers[3]
    adapter.resolve("blocks.-1.attn.k")     # negative block indices work

Block layouts are recognised by structure (`structure.py`), finished and checked by one
probe forward on a few tokens against the model's own `output_hidden_states` (`verify.py`).
"""

from __future__ import annotations

import warnings

from torch import nn

from conceptlens.adapters import families, residual
from conceptlens.adapters.block_view import BlockView, as_hidden, block_view, resid_shape
from conceptlens.adapters.depth import again_note, later_reads
from conceptlens.adapters.attention_sites import AttentionSites, in_width
from conceptlens.adapters.keys import relayout
from conceptlens.adapters.direct import reprobe_direct
from conceptlens.adapters.names import NameResolver
from conceptlens.adapters.padded import centre_offset, cut_padded, site_extras
from conceptlens.adapters.probe_pass import Trace, run_probe
from conceptlens.hooks.manager import HookManager
from conceptlens.adapters.repeated import Final, find_final, only_list, same_class, unroll
from conceptlens.adapters.site_notes import attention_notes
from conceptlens.adapters.stacks import (StackPaths, after_candidates, block_list, expected_layers,
                                         final_norm_candidates, find_block_list, find_stacks, get_path, hidden_size,
                                         norms_beside, parallel_blocks, parallel_records)
from conceptlens.adapters.stream_writes import site_shape, stream_writes
from conceptlens.adapters.structure import BlockLayout, children_summary, mlp_container, recognise
from conceptlens.adapters.sublayers import extend, more_attention, out_projection, plus_modules
from conceptlens.adapters.repair import repair
from conceptlens.adapters.verify import check_stack, refine
from conceptlens.adapters.verify import submodule as _get
from conceptlens.adapters.readings import Readings, site_views
from conceptlens.sites.hooked_views import CallOf, Trim
from conceptlens.sites.site import Site

_OUT_KINDS = ("attn_out", "cross_attn_out", "mixer_out", "mlp_out", "branch_out")


class Adapter(AttentionSites):
    """Every site of a model, found from its own modules (nothing is reimplemented)."""

    _current: tuple[nn.Module, int, nn.Module] | None = None
    _block: nn.Module | None = None
    _trace: Trace | None = None
    _view = BlockView()

    def __init__(self, model: nn.Module, *, verify: bool = True, hooks: HookManager | None = None) -> None:
        self.model = model
        self.config = model.config
        self.model_type = getattr(self.config, "model_type", type(model).__name__)
        if self.model_type in families.REFUSED:
            raise ValueError(f"conceptlens cannot attach to {self.model_type}: {families.REFUSED[self.model_type]}")
        base = getattr(model, "base_model", model)
        self.spec = StackPaths(find_stacks(model))
        self.stacks = {p: get_path(base, path) for p, path in self.spec.stacks.items()}
        self.blocks: dict[str, list[nn.Module]] = {}
        self.layouts: dict[str, list[BlockLayout]] = {}
        self.problems: dict[str, str] = {}
        """Site name -> why it is missing (an additive block whose outputs did not add up)."""
        self.generic = self.model_type not in families.LAYOUT
        self._io: dict[nn.Module, tuple[nn.Module, nn.Module]] = {}
        """Block made of parallel lists -> (module reading its input, module giving its output)."""
        for prefix, stack in self.stacks.items():
            self._find_blocks(prefix, stack)
        finals = {p: [get_path(s, c) for c in final_norm_candidates(s, self._block_paths[p])]
                  for p, s in self.stacks.items()}
        afters = {p: [get_path(s, c) for c in after_candidates(s, self._block_paths[p])]
                  for p, s in self.stacks.items()}
        extra = [m for ms in (*finals.values(), *afters.values()) for m in ms]
        hooks = hooks or HookManager(model)  # the probes' hooks (a manager of their own if none is given)
        trace = run_probe(hooks, self.blocks, extra, self.stacks)
        self.direct, trace = reprobe_direct(hooks, self.blocks, trace,  # blocks whose forward the stack calls directly
                                            lambda: run_probe(hooks, self.blocks, extra, self.stacks))
        if self._add_same_class(trace):  # looped stacks of one layer class (HRM's two modules): probe again
            finals = {p: norms_beside(stack, self.blocks[p], finals[p]) for p, stack in self.stacks.items()}
            extra = [m for ms in (*finals.values(), *afters.values()) for m in ms]
            trace = run_probe(hooks, self.blocks, extra, self.stacks)
        parallel_records(trace, self._io)
        self.calls: dict[str, list[int] | None] = {p: self._unroll(p, trace) for p in self.stacks}
        """Stack -> for each block, which call of its module it is (None: every block is its own module)."""
        self.sites: dict[str, Site] = {}
        self.n_blocks = {p: len(b) for p, b in self.blocks.items()}
        self.names = NameResolver(self)
        self.hidden_offset: dict[str, int] = {}
        """Stack -> index of block 0's output in HF's hidden states (1, or 0 for Mamba-style)."""
        self.padded_hidden = cut_padded(trace)
        """Stacks whose HF hidden states keep padding the model adds (PEGASUS-X): sites are their first T."""
        for prefix in self.stacks:
            final = find_final(self._last_output(prefix, trace), finals[prefix], afters[prefix],
                               trace.hidden.get(prefix), trace)
            for block, lay in zip(self.blocks[prefix], self.layouts[prefix]):
                refine(block, lay, trace)
                relayout(block, lay, trace, prefix)
                for key, path in families.LAYOUT.get(self.model_type, {}).items():
                    setattr(lay, key, path)
            self._view = block_view(self.blocks[prefix][0], trace, trace.hidden.get(prefix))
            self.hidden_offset[prefix] = check_stack(prefix, self.blocks[prefix], final.module, trace, self._what(),
                                                     self.calls[prefix], final.call, self._view) if verify else 1
            self._add_stack(prefix, final, trace)

    @property
    def family(self) -> str:
        """Deprecated: the model type (`config.model_type`), now `model_type`."""
        warnings.warn("Adapter.family is renamed Adapter.model_type", DeprecationWarning, stacklevel=2)
        return self.model_type

    def _what(self) -> str:
        return f"{self.model_type} ({type(self.model).__name__})"

    def _find_blocks(self, prefix: str, stack: nn.Module) -> None:
        self._block_paths = getattr(self, "_block_paths", {})
        path = find_block_list(stack, expected_layers(self.config, prefix))
        if path is None:
            raise ValueError(f"cannot find the list of blocks in {type(stack).__name__} ({self._what()}): "
                             "no ModuleList of layers")
        blocks = block_list(stack, path)
        if all(recognise(b) is None for b in blocks):  # groups of layers (ALBERT's layer groups)
            groups = [group for b in blocks if (group := only_list(b)) is not None]
            if len(groups) == len(blocks):
                blocks = [m for group in groups for m in group]
            elif (synth := parallel_blocks(stack, path)) is not None:  # XLM: one ModuleList per sublayer
                blocks = [b for b, _, _ in synth]
                self._io.update({b: (first, last) for b, first, last in synth})
        self._block_paths[prefix] = path
        self.blocks[prefix], self.layouts[prefix] = blocks, [self._recognise(b, i) for i, b in enumerate(blocks)]

    def _recognise(self, block: nn.Module, i: int) -> BlockLayout:
        lay = recognise(block)
        if lay is None:
            raise ValueError(f"cannot recognise the layout of {type(block).__name__} (block {i} of "
                             f"{self._what()}; children: {children_summary(block)}): no attention, mixer "
                             "or MLP module found")
        return lay

    def _add_same_class(self, trace: Trace) -> bool:
        changed = False
        for prefix, blocks in self.blocks.items():
            more = same_class(blocks, self.stacks[prefix], trace, trace.hidden.get(prefix))
            if more:
                self.blocks[prefix] = blocks + more
                self.layouts[prefix] = self.layouts[prefix] + [self._recognise(m, i) for i, m in
                                                               enumerate(more, len(blocks))]
                changed = True
        return changed

    def _unroll(self, prefix: str, trace: Trace) -> list[int] | None:
        """Block i becomes the i-th call of a layer run several times per forward (site.call)."""
        found = unroll(self.blocks[prefix], trace, trace.hidden.get(prefix))
        if found is None:
            return None
        self.blocks[prefix], calls = found
        self.layouts[prefix] = [self._recognise(m, i) for i, m in enumerate(self.blocks[prefix])]
        return calls

    def _last_output(self, prefix: str, trace: Trace):
        calls = self.calls.get(prefix)
        last = trace.io(self.blocks[prefix][-1], calls[-1] if calls else None)[1]
        return last[:, :trace.lengths[prefix]] if prefix in self.padded_hidden and last is not None else last

    def _add_stack(self, prefix: str, final: Final, trace: Trace) -> None:
        p = f"{prefix}." if prefix else ""
        blocks = self.blocks[prefix]
        x0 = as_hidden(trace.inputs.get(blocks[0]), self._view, 1)
        resid = resid_shape(x0, self._view) if x0 is not None else ("B", "T", hidden_size(self.config))
        calls, again = self.calls.get(prefix), later_reads(blocks, trace)
        self._trace = trace
        for i, (block, lay) in enumerate(zip(blocks, self.layouts[prefix])):
            self._current, self._block = (block, calls[i], self.stacks[prefix]) if calls else None, block
            self._add_block(prefix, i, block, lay, trace, resid, again)
        module, k, note = final.module, final.call, final.note
        self._current = (module, k, self.stacks[prefix]) if module is not None and k is not None else None
        self._block = None
        if module is not None:
            out = trace.io(module, k)[1]
            shape = ("B", "T", int(out.shape[-1])) if out is not None and out.ndim == 3 else resid  # streams merged
            cls = type(module).__name__
            self._add(f"{p}final", module, "output", shape, prefix, f"output of the final norm ({cls})"
                      if note is None else f"output of {cls}, the stack's last hidden state; {note}")
        self._current = None

    def _add_block(self, prefix: str, i: int, block: nn.Module, lay: BlockLayout, trace: Trace, resid: tuple,
                   again) -> None:
        """Every site of block `i`: residual points, sublayer outputs, attention, MLP neurons."""
        p = f"{prefix}." if prefix else ""
        b, cls = f"{p}blocks.{i}", type(block).__name__
        first, last = self._io.get(block, (block, block))
        if lay.additive:
            extend(block, lay, trace)  # several sublayers of one kind, a further branch
        problem, scales, plus = repair(block, lay, trace) if lay.additive else (None, None, None)
        if problem and (fitted := residual.refit(block, lay, trace)) is not None:
            problem, scales = None, fitted
        spread = stream_writes(block, lay, trace) if problem else None  # hyper-connection streams
        problem = None if spread else problem
        if i == 0:
            self._add(f"{p}embed", first, "input", resid, prefix, f"input to {cls} 0" + residual.before(lay, p),
                      resid=True)
        rin, point = (block.get_submodule(lay.resid_in), "output") if lay.resid_in else (first, "input")
        eq = f"; {e}" if (e := residual.equation(lay)) else ""
        eq += " (the block does not add its input)" if lay.resid_coef == 0.0 else ""  # Inkling 2's boundary
        where = f"{lay.resid_in} ({type(rin).__name__}) in {cls}" if lay.resid_in else type(rin).__name__
        self._add(f"{b}.resid_in", rin, point, resid, prefix, f"{point} of {where} {i} ({lay.style})" +
                  again_note(i, again, p), resid=True)
        self._add(f"{b}.resid_out", last, "output", resid, prefix, f"output of {type(last).__name__} {i}{eq}",
                  resid=True)
        self._add_sublayers(prefix, b, i, block, lay, trace, resid, (problem, scales, plus, spread))
        notes, more = attention_notes(self.config, i, _get(block, lay.attn)), more_attention(block, lay, trace)
        z_path = lay.attn_z or (out_projection(block, lay.attn) if more else None)
        sublayer = f"the block's attention sublayer {lay.attn}" if more else ""
        self._add_attention(f"{b}.attn", block, lay.attn, z_path, prefix, prefix, trace,
                            "; ".join(filter(None, (notes, sublayer))))
        for j, path in enumerate(more, 1):  # further attention sublayers: attn_1, ...
            self._add_attention(f"{b}.attn_{j}", block, path, out_projection(block, path), prefix, prefix, trace,
                                "; ".join(filter(None, (notes, f"the block's attention sublayer {path}"))))
        if lay.cross_attn and prefix == "decoder":
            self._add_attention(f"{b}.cross_attn", block, lay.cross_attn, None, prefix, "encoder", trace, "")
        if lay.mlp_post and not lay.flat_mlp and (module := _get(block, lay.mlp_post)) is not None:
            self._add(f"{b}.mlp.post", module, "input", ("B", "T", in_width(module)), prefix,
                      f"input of {lay.mlp_post} ({type(module).__name__}): the MLP's hidden activations")
        if (mlp := mlp_container(lay)) is not None and (module := _get(block, mlp)) is not None \
                and (x := trace.inputs.get(module)) is not None and x.ndim == 3:
            self._add(f"{b}.mlp.in", module, "input", ("B", "T", int(x.shape[-1])), prefix,
                      f"input of {mlp} ({type(module).__name__}): what the MLP reads (a transcoder's source)")

    def _add_sublayers(self, prefix: str, b: str, i: int, block: nn.Module, lay: BlockLayout, trace: Trace,
                       resid: tuple, readings: tuple) -> None:
        """attn_out, mlp_out, ...: each sublayer's contribution, as `repair` and the residual rules read it."""
        problem, scales, plus, spread = readings
        for kind in _OUT_KINDS:
            path = getattr(lay, kind)
            if path is None:
                continue
            if problem or kind in lay.dropped:
                self.problems[f"{b}.{kind}"] = f"{self._what()} block {i}: {problem or lay.dropped[kind]}"
                continue
            module = block.get_submodule(path)
            scale = scales.get(kind, 1.0) if scales is not None else 1.0
            note = residual.sublayer_note(lay, kind, scales, scale)
            shape = site_shape(resid, module, trace, bool(spread) and kind in spread)
            self._add(f"{b}.{kind}", module, "output", shape, prefix,
                      f"output of {path} ({type(module).__name__})" + (f"; {note}" if note else ""),
                      flat_in=block if kind == "mlp_out" and lay.flat_mlp else None, scale=scale,
                      plus=plus_modules(block, lay, kind, plus), expand=spread.get(kind) if spread else None,
                      row_offset=centre_offset(trace.outputs.get(module), trace.inputs.get(block)),
                      inner=CallOf(module, block.get_submodule(lay.inner_calls[kind][1]), lay.inner_calls[kind][0])
                      if kind in lay.inner_calls else None)  # one call of a module inside the sublayer (inner.py)

    def _add(self, name: str, module: nn.Module, point, shape, stack: str, source: str, heads=None,
             flat_in=None, scale: float = 1.0, plus: nn.Module | None = None, view: BlockView | None = None,
             part=None, row_offset: int = 0, inner: CallOf | None = None, expand=None, resid: bool = False) -> None:
        """Add a site; its views come from the readings (adapters/readings.py) and describe themselves."""
        shared = self._shared_call()
        if shared is not None and inner is not None:  # (a shared layer's site is already gated on its calls)
            self.problems[name] = f"{self._what()}: {name} is one call of a module inside a shared layer's sublayer"
            return
        view = self._view if view is None else view
        trim = Trim(None, offset=row_offset) if row_offset else None
        if view.added != "none":  # T: the length of this forward's input to the site's stack
            own = self.stacks[stack] if stack in self.stacks else self.stacks[self._stack_of(name)]
            trim = Trim(own, last=view.added == "before", offset=row_offset)
        trace = None if inner is not None else self._trace  # one chosen call of a module inside the sublayer
        extras = site_extras(module, point, view.channels_first, self.direct, self._block, trace, row_offset,
                             shape[1] == "T")
        if extras is None:  # a module the block runs more than once, first on other rows: left out
            return
        readings = Readings(heads=heads, part=part, expand=expand, flat_in=flat_in, plus=plus, scale=scale,
                            call=inner if shared is None else shared, streams_first=view.streams_first and resid,
                            time_major=view.time_major, trim=trim, **extras)
        views = site_views(point, readings)
        notes = "".join(f"; {note}" for v in views if (note := v.describe()))
        self.sites[name] = Site(name, module, point, shape, stack, source + notes, views)

    def _shared_call(self) -> CallOf | None:
        """Sites of a block that is one call of a layer run several times per forward: that call."""
        if self._current is None:
            return None
        block, call, stack = self._current
        return CallOf(block, stack, call, f"call {call} of this shared {type(block).__name__} in each forward")

    def _stack_of(self, name: str) -> str:
        head = name.split(".", 1)[0]
        return head if head in self.stacks else ""

    def layout(self, stack: str, index: int) -> BlockLayout:
        """The recognised layout of block `index` of `stack` ("" for single-stack models)."""
        return self.layouts[stack][index]

    def resolve(self, name: str) -> Site:
        """The Site called `name`; negative block indices, TransformerLens and HF module names work."""
        return self.names.resolve(name)

    def canonical(self, name: str) -> str:
        return self.names.canonical(name)
