"""Checks shared by the coverage test: one tiny model of a type against HF's own outputs."""

from __future__ import annotations

import re
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import torch

import conceptlens
from conceptlens.adapters.probe_pass import first_tensor
from conceptlens.sites.hooked_views import CallOf, Trim
from conceptlens.sites.views import ChannelsFirst, StreamsFirst, TimeMajor
from tests.adapters.tiny_configs import build
from tests.conftest import Batches


# a block's self-attention sites: `attn.*`, and `attn_1.*`, ... for its further attention sublayers
_SELF_ATTN = re.compile(r"\.attn(_\d+)?\.[a-z_]+$")
SUBLAYERS = ("attn_out", "cross_attn_out", "mixer_out", "mlp_out", "branch_out")


class NotBuildable(Exception):
    """transformers itself cannot build or run this type from a tiny text config."""


# The comparisons a model type can get, in the order the summary prints them.
COMPARISONS = ("embed = hidden_states[0]", "resid_out = hidden_states", "sublayer sum = resid_out",
               "pattern (captured q, k) = eager weights", "k/v with cache = without", "cached forward refused",
               "mlp.post = down projection's input")


@dataclass
class Ledger:
    """Which comparisons ran for one model type (how many sites each), and why the others did not."""

    ran: Counter = field(default_factory=Counter)
    skipped: dict[str, str] = field(default_factory=dict)

    def did(self, comparison: str, n: int = 1) -> None:
        assert comparison in COMPARISONS, comparison
        self.ran[comparison] += n

    def skip(self, comparison: str, reason: str) -> None:
        assert comparison in COMPARISONS, comparison
        if not self.ran[comparison]:
            self.skipped.setdefault(comparison, reason)


LEDGERS: dict[str, Ledger] = {}
"""model type -> its ledger, filled by the coverage test; tests/conftest.py prints the counts."""
OUTCOMES: dict[str, str] = {}
"""model type -> "checked", "refused" (a clear error, as expected) or "not buildable" (transformers' own failure)."""


def summary() -> list[str]:
    """One line per comparison: types compared (sites), types skipped and their reasons."""
    lines = [f"coverage comparisons over {len(LEDGERS)} model types:"]
    for what in COMPARISONS:
        ran = [t for t, led in LEDGERS.items() if led.ran[what]]
        sites = sum(led.ran[what] for led in LEDGERS.values())
        reasons = Counter(led.skipped[what] for led in LEDGERS.values() if what in led.skipped and not led.ran[what])
        why = "; ".join(f"{n} {r}" for r, n in reasons.most_common())
        lines.append(f"  {what}: {len(ran)} types ({sites} sites) compared, {sum(reasons.values())} not: {why}")
    return lines


def inputs_for(model, length: int = 6) -> dict:
    g = torch.Generator().manual_seed(0)
    vocab = int(getattr(model.config.get_text_config(), "vocab_size", 128) or 128)
    ids = torch.randint(4, min(vocab, 100), (2, length), generator=g)
    inputs = {"input_ids": ids}
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = torch.randint(4, min(vocab, 100), (2, length - 1), generator=g)
    return inputs


def reference(model_type: str):
    """(model, inputs, HF output with hidden states) or NotBuildable."""
    try:
        model = build(model_type)
        inputs = inputs_for(model)
        with torch.no_grad():  # without a cache, as the sites are checked (check_kv_cache tries one)
            try:
                out = model(**inputs, output_hidden_states=True, use_cache=False)
                inputs["use_cache"] = False  # every later forward of the checks too
            except TypeError as err:
                if "use_cache" not in str(err):
                    raise
                out = model(**inputs, output_hidden_states=True)
    except Exception as err:  # transformers' own failure: not ours to count
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
        raise NotBuildable(f"{type(err).__name__}: {first[:160]}") from err
    return model, inputs, out


def forward_with(model, inputs, handles, **kwargs):
    """One no-grad forward with the hook `handles` attached; they are removed after it, whatever happens."""
    try:
        with torch.no_grad():
            return model(**inputs, **kwargs)
    finally:
        for handle in handles:
            handle.remove()


def hidden(out, stack: str):
    if stack == "encoder":
        return out.encoder_hidden_states
    if stack == "decoder":
        return out.decoder_hidden_states
    return out.hidden_states


def capture_all(lens, model, inputs, names):
    cap = Batches()
    with lens.capture(names, keep_shape=True, on_batch=cap), torch.no_grad():
        model(**inputs)
    return cap.acts


def close(a, b, tol=1e-5) -> bool:
    b = b[0] if isinstance(b, (tuple, list)) else b  # PEGASUS-X lists (token, global) states
    return a.shape == b.shape and bool(((a - b).abs().max() <= tol * (1 + b.abs().max())).item())


def check_model(model, inputs, out, partial: bool = False, ledger: Ledger | None = None) -> None:
    ledger = ledger if ledger is not None else Ledger()
    lens = conceptlens.attach(model)
    assert partial or not lens.adapter.problems, lens.adapter.problems
    for stack, n in lens.adapter.n_blocks.items():
        p = f"{stack}." if stack else ""
        hs = hidden(out, stack)
        if stack in lens.adapter.padded_hidden:  # HF keeps the model's own padding (PEGASUS-X): the tokens are first
            length = inputs["decoder_input_ids" if stack == "decoder" else "input_ids"].shape[1]
            hs = [h[:, :length] if isinstance(h, torch.Tensor) else h for h in hs]
        if lens.sites[f"{p}embed"].find(StreamsFirst):  # (n, B, T, d) in HF's list: the sites are (B, T, n, d)
            hs = [h.permute(1, 2, 0, 3) if isinstance(h, torch.Tensor) else h for h in hs]
        names = [f"{p}embed"] + [f"{p}blocks.{i}.{k}" for i in range(n)
                                 for k in ("resid_in", "resid_out") + SUBLAYERS
                                 if f"{p}blocks.{i}.{k}" in lens.sites]
        names += [f"{p}final"] if f"{p}final" in lens.sites else []
        with _add_points(lens, stack) as points:  # the tensors a chain of residual adds combines
            acts = capture_all(lens, model, inputs, names)
        offset = lens.adapter.hidden_offset[stack]  # 0: the model lists block outputs only (Mamba)
        assert offset in (0, 1)
        if offset:
            assert close(acts[f"{p}embed"], hs[0]), "embed != hidden_states[0]"
            ledger.did("embed = hidden_states[0]")
        else:
            ledger.skip("embed = hidden_states[0]", "HF lists block outputs only")
        for i in range(n):
            ref = hs[i + offset] if i + offset < n else hs[n]
            got = acts[f"{p}blocks.{i}.resid_out"]
            if i == n - 1 and f"{p}final" in lens.sites and not close(got, ref):
                got = acts[f"{p}final"]
            assert close(got, ref), f"{p}blocks.{i}.resid_out != hidden_states[{i + 1}]"
            ledger.did("resid_out = hidden_states")
            dropped = any(k.startswith(f"{p}blocks.{i}.") for k in lens.adapter.problems)
            lay = lens.adapter.layout(stack, i)
            if lay.adds:
                _check_adds(lay, acts, points[i], f"{p}blocks.{i}")
                ledger.did("sublayer sum = resid_out")
            elif not lay.additive:
                ledger.skip("sublayer sum = resid_out", "blocks not additive (post-norm or mixing)")
            elif dropped:
                ledger.skip("sublayer sum = resid_out", "sublayer sites dropped with a reason")
            else:  # resid_coef: the detected coefficient on resid_in (Beam's < 1);
                # the sublayers a reversible block adds to its other stream are left out
                total = lay.resid_coef * acts[f"{p}blocks.{i}.resid_in"] + \
                    sum(acts[f"{p}blocks.{i}.{k}"] for k in SUBLAYERS if f"{p}blocks.{i}.{k}" in acts and
                        k not in lay.other_stream)
                assert close(total, acts[f"{p}blocks.{i}.resid_out"], 1e-4), \
                    f"{p}blocks.{i}: resid_coef * resid_in + attn_out + mlp_out != resid_out"
                ledger.did("sublayer sum = resid_out")
    check_mlp_post(lens, model, inputs, ledger)


def check_mlp_post(lens, model, inputs, ledger: Ledger) -> None:
    """Every `mlp.post` site's values equal what its down projection receives, read by a plain
    forward pre-hook (not only its width): the neurons as the model computes them."""
    names = [n for n in lens.sites if n.endswith(".mlp.post")]
    if not names:
        ledger.skip("mlp.post = down projection's input", "no mlp.post site")
        return
    seen: dict[str, list] = {n: [] for n in names}
    handles = [lens.sites[n].module.register_forward_pre_hook(
        lambda m, args, kw, got=seen[n]: got.append(first_tensor(args or tuple(kw.values())).detach().clone()),
        with_kwargs=True) for n in names]
    try:
        acts = capture_all(lens, model, inputs, names)
    finally:
        for h in handles:
            h.remove()
    for name in names:
        site, got = lens.sites[name], acts[name]
        calls = seen[name]
        call, trim = site.find(CallOf), site.find(Trim)
        raw = calls[call.call if call is not None else 0] if calls else None
        if raw is None or (len(calls) > 1 and call is None):
            ledger.skip("mlp.post = down projection's input", f"its module ran {len(calls)} times")
            continue
        if site.find(TimeMajor):
            raw = raw.transpose(0, 1)
        if site.find(ChannelsFirst):  # (B, d, T): Conv1d blocks (SqueezeBERT)
            raw = raw.transpose(1, -1)
        if raw.numel() != got.numel() or trim is not None and (trim.last and trim.stack is not None or trim.offset):
            ledger.skip("mlp.post = down projection's input", "the module sees other rows than the tokens")
            continue
        assert close(got, raw.reshape(got.shape).float()), f"{name} differs from its down projection's input"
        ledger.did("mlp.post = down projection's input")


def _check_adds(lay, acts, points, b: str) -> None:
    """A block that is a chain of scaled residual adds: every sublayer site is in one add, and
    each add's target == coef * source + its sites (the equation detected at attach)."""
    kinds = [k for a in lay.adds for k in a.kinds]
    assert sorted(kinds) == sorted(k for k in SUBLAYERS if f"{b}.{k}" in acts), (b, kinds)
    for add in lay.adds:
        total = add.coef * points[add.source] + sum(acts[f"{b}.{k}"] for k in add.kinds)
        assert close(total, points[add.target], 1e-4), f"{b}: {add} does not hold"


@contextmanager
def _add_points(lens, stack: str):
    """{block index: {point: tensor}} for the blocks of `stack` with residual adds, filled by the
    next forward (a block that is one call of a shared layer takes its call's tensors)."""
    found: dict[int, dict] = {}
    records: list[tuple[int, tuple, int, list]] = []
    handles = []
    calls = lens.adapter.calls.get(stack)
    try:
        for i, (block, lay) in enumerate(zip(lens.adapter.blocks[stack], lens.adapter.layouts[stack])):
            for point in {pt for a in lay.adds for pt in (a.source, a.target)}:
                module, seen = (block.get_submodule(point[0]) if point[0] else block), []
                if point[1] == "input":
                    handles.append(module.register_forward_pre_hook(
                        lambda m, args, kw, seen=seen: seen.append(first_tensor(args or kw.get("hidden_states"))),
                        with_kwargs=True))
                else:
                    handles.append(module.register_forward_hook(
                        lambda m, args, out, seen=seen: seen.append(first_tensor(out))))
                records.append((i, point, calls[i] if calls else 0, seen))
        yield found
        for i, point, call, seen in records:
            found.setdefault(i, {})[point] = seen[call].float()
    finally:
        for h in handles:
            h.remove()


def check_kv_cache(model, inputs, refused: bool = False, one_decoder_token: bool = False,
                   ledger: Ledger | None = None) -> None:
    """k/v sites read at the KV cache's update (a forward with a cache) equal those read at the
    attention function (no cache): the keys a cache stores are the keys the scores use. Where
    the module attends to other k/v than it stores (`refused`), a cached forward must refuse.
    `one_decoder_token`: the model computes another function with a cache on several decoder
    tokens (FSMT drops its causal mask then), so both forwards get one decoder token."""
    ledger = ledger if ledger is not None else Ledger()
    what = "cached forward refused" if refused else "k/v with cache = without"
    lens = conceptlens.attach(model)
    inputs = {k: v for k, v in inputs.items() if k != "use_cache"}
    if one_decoder_token:
        inputs["decoder_input_ids"] = inputs["decoder_input_ids"][:, :1]
    names = [n for n in lens.sites if _SELF_ATTN.search(n) and n.endswith((".k", ".v"))]
    if not names:
        return ledger.skip(what, "no self-attention k/v site")
    if not getattr(model.config.get_text_config(decoder=True), "use_cache", False):
        return ledger.skip(what, "the config has no KV cache")
    try:
        with torch.no_grad():
            out = model(**inputs, use_cache=True)
    except Exception:  # transformers itself refuses a cache here (Switch's encoder)
        return ledger.skip(what, "transformers refuses use_cache")
    if getattr(out, "cache", getattr(out, "past_key_values", None)) is None:
        return ledger.skip(what, "the forward returns no cache")
    fresh = Batches()
    with lens.capture(names, keep_shape=True, on_batch=fresh), torch.no_grad():
        model(**inputs, use_cache=False)
    if refused:
        with pytest.raises(ValueError, match="attends to other keys/values than it stores"), torch.no_grad(), \
                lens.capture(names, keep_shape=True):
            model(**inputs, use_cache=True)
        return ledger.did(what, len(names))
    cached = Batches()
    with lens.capture(names, keep_shape=True, on_batch=cached), torch.no_grad():
        model(**inputs, use_cache=True)
    for name in names:
        assert close(cached.acts[name], fresh.acts[name], 1e-6), f"{name} differs with a KV cache"
    ledger.did(what, len(names))


def check_attention(model, inputs, sink_scaled: bool = False, ledger: Ledger | None = None) -> None:
    """Every block whose attention calls the attention function has q/k/v sites, and its
    pattern (from the captured q/k and the model's mask) equals the eager attention weights."""
    ledger = ledger if ledger is not None else Ledger()
    what = "pattern (captured q, k) = eager weights"
    lens = conceptlens.attach(model)
    for stack in lens.adapter.n_blocks:
        p = f"{stack}." if stack else ""
        names = [n for n in lens.sites if n.startswith(f"{p}blocks.") and _SELF_ATTN.search(n) and
                 n.endswith(".pattern")]
        for name in names:
            base = name[: -len("pattern")]
            assert all(f"{base}{w}" in lens.sites for w in "qkv"), name
        if not names:
            ledger.skip(what, "no attention pattern site")
            continue
        cap = Batches()
        with lens.capture(names, keep_shape=True, on_batch=cap), torch.no_grad():
            out = model(**inputs, output_attentions=True)
        attentions = {"encoder": getattr(out, "encoder_attentions", None),
                      "decoder": getattr(out, "decoder_attentions", None)}.get(stack, getattr(out, "attentions", None))
        if not attentions:
            ledger.skip(what, "HF returns no attention weights")
            continue
        attentions = [a for a in attentions if a is not None]
        n = lens.adapter.n_blocks[stack]
        for j, name in enumerate(names):
            index = int(name.split(".")[len(p.split(".")) if p else 1])
            ref = attentions[index] if len(attentions) == n else attentions[j] if len(attentions) == len(names) else None
            if ref is None:
                ledger.skip(what, "HF's attention list does not match the blocks")
                continue
            got = cap.acts[name].transpose(1, 2)
            if sink_scaled:  # HF returns the weights before its post-softmax sink scaling; ours include the sink
                assert bool((got.sum(-1) < 1).all())
                got = got / got.sum(-1, keepdim=True)
            assert got.shape == ref.shape and torch.allclose(got, ref.float(), atol=1e-5), \
                f"{name} differs from the eager attention weights"
            ledger.did(what)
