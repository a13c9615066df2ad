"""The hook manager of a lens: it lists what it attached, `close()` restores the model exactly,
lenses on two models (also in two threads) share nothing, and steering scopes add and remove
only their own hooks."""

from __future__ import annotations

import importlib
import pkgutil
import threading
import weakref
from collections import OrderedDict, defaultdict

import pytest
import torch
from transformers import DynamicCache

import conceptlens
import conceptlens.hooks
from conceptlens.steering import Add
from tests.adapters.tiny_configs import build
from tests.conftest import Batches, hook_snapshot, tiny_inputs, tiny_model

SITES = ["blocks.0.resid_in", "blocks.0.attn.q", "blocks.1.attn.k", "blocks.1.attn.v", "blocks.1.attn.pattern",
         "blocks.1.mlp_out", "final"]


def _model_state(model) -> dict:
    """Hook dicts of every module, instance attributes named like methods, and the attention registry."""
    snap = hook_snapshot(model)
    for name, module in model.named_modules():
        snap[(name, "instance")] = {k: v for k, v in vars(module).items() if k in ("forward", "__call__")}
    return snap


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def test_close_inside_open_scopes_restores_the_model_exactly():
    model, inputs = tiny_model("llama"), tiny_inputs("llama")
    bare, before = _logits(model, inputs), _model_state(model)
    lens = conceptlens.attach(model)
    assert lens.hooks.attached() == [] and _model_state(model) == before  # attaching leaves nothing
    cache = DynamicCache(config=model.config)
    capture = lens.capture(SITES, keep_shape=True).__enter__()
    steer = lens.steer(Add(torch.ones(32), 2.0, site="blocks.0.resid_out"),
                       Add(torch.ones(16), 1.0, site="blocks.1.attn.v")).__enter__()
    lens.hook("blocks.1.mlp_out", lambda x: None)
    with torch.no_grad():
        model(**inputs, cache=cache, use_cache=True)
    kinds = {a.kind for a in lens.hooks.attached()}
    assert kinds == {"forward_hook", "forward_pre_hook", "attention_registry"}
    assert ("forward_hook", "model.layers.1.mlp") in {(a.kind, a.target) for a in lens.hooks.attached()}
    lens.close()  # scopes still open
    assert lens.hooks.attached() == [] and _model_state(model) == before and "update" not in vars(cache)
    assert torch.equal(_logits(model, inputs), bare)
    steer.__exit__(None, None, None)  # leaving them afterwards is harmless
    capture.__exit__(None, None, None)
    assert _model_state(model) == before
    with pytest.raises(RuntimeError, match="closed"):
        lens.capture("final").__enter__()


def test_close_during_a_cached_forward_restores_the_cache_method():
    model, inputs = tiny_model("llama"), tiny_inputs("llama")
    before = _model_state(model)
    cache = DynamicCache(config=model.config)
    with conceptlens.attach(model) as lens:
        lens.hook("blocks.0.attn.k", lambda x: None)
        lens.hook("blocks.1.attn.k", lambda x: lens.close())  # while layer 1's cache.update is patched
        assert any(a.kind == "patch" for a in _attached_during_update(lens, model, inputs, cache))
    assert _model_state(model) == before and "update" not in vars(cache)


def _attached_during_update(lens, model, inputs, cache):
    seen = []
    lens.hook("blocks.0.attn.v", lambda x: seen.extend(lens.hooks.attached()))
    with torch.no_grad():
        model(**inputs, cache=cache, use_cache=True)
    return seen


def test_a_routed_forward_is_listed_and_restored():
    model = build("squeezebert")
    layer = model.transformer.encoder.layers[1]
    before = _model_state(model)
    with conceptlens.attach(model) as lens:
        lens.hook("blocks.1.resid_out", lambda x: None)
        assert "forward" in vars(layer)
        assert ("patch", "transformer.encoder.layers.1", "forward") in lens.hooks.attached()
    assert _model_state(model) == before


def test_no_module_level_mutable_state_in_hooks():
    mutable = (dict, list, set, OrderedDict, defaultdict, weakref.WeakKeyDictionary, weakref.WeakValueDictionary,
               weakref.WeakSet)
    found = []
    for info in pkgutil.iter_modules(conceptlens.hooks.__path__):
        module = importlib.import_module(f"conceptlens.hooks.{info.name}")
        found += [f"{info.name}.{name}" for name, value in vars(module).items()
                  if not name.startswith("__") and isinstance(value, mutable)]
    assert found == []


def test_two_lenses_on_two_models_share_nothing():
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    inputs = tiny_inputs("llama")
    registry = hook_snapshot(a)["attention_registry"]
    ref_a, ref_b = _logits(a, inputs), _logits(b, inputs)
    lens_a, lens_b = conceptlens.attach(a), conceptlens.attach(b)
    seen_a, seen_b = Batches(), Batches()
    with lens_a.capture("blocks.1.attn.k", on_batch=seen_a):
        assert lens_b.hooks.attached() == [] and not lens_b.hooks.qkv
        with lens_b.capture("blocks.1.attn.k", on_batch=seen_b), torch.no_grad():
            lens_a.close()  # a's registry entry lies under b's: it is spliced out, b's keeps working
            assert torch.equal(b(**inputs).logits, ref_b) and torch.equal(a(**inputs).logits, ref_a)
        assert not seen_a and len(seen_b) == 1  # a's capture read nothing after the close
    assert hook_snapshot(a)["attention_registry"] == registry == hook_snapshot(b)["attention_registry"]


def test_two_threads_with_a_lens_each_share_nothing():
    models = [tiny_model("llama", seed=s) for s in (0, 1)]
    inputs = tiny_inputs("llama")
    vectors = [torch.full((16,), 1.0), torch.full((16,), -2.0)]

    def run(i, out):
        lens = conceptlens.attach(models[i])
        for _ in range(5):
            seen = Batches()
            with lens.steer(Add(vectors[i], 1.0, site="blocks.0.attn.v")), \
                    lens.capture(["blocks.1.attn.q", "blocks.1.attn.k"], on_batch=seen), torch.no_grad():
                logits = models[i](**inputs).logits
            out.append((logits, seen.acts["blocks.1.attn.k"]))
        lens.close()

    alone = [[], []]
    for i in (0, 1):
        run(i, alone[i])
    together = [[], []]
    threads = [threading.Thread(target=run, args=(i, together[i])) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in (0, 1):
        assert len(together[i]) == 5
        for (logits, k), (ref_logits, ref_k) in zip(together[i], alone[i]):
            torch.testing.assert_close(logits, ref_logits)
            torch.testing.assert_close(k, ref_k)


def test_a_scope_adds_and_removes_only_its_own_hooks():
    model = tiny_model("llama")
    lens = conceptlens.attach(model)
    outer_edit = Add(torch.ones(32), 1.0, site="blocks.0.resid_out")
    with lens.steer(outer_edit):
        outer, snap = lens.hooks.attached(), hook_snapshot(model)
        block1 = model.model.layers[1]
        with lens.steer(Add(torch.ones(32), 2.0, site="blocks.1.resid_out"), Add(-torch.ones(32), 1.0,
                                                                                site="blocks.0.resid_out")):
            inner = lens.hooks.attached()
            assert inner[:len(outer)] == outer  # the outer scope's hooks were not touched
            assert inner[len(outer):] == [("forward_hook", "model.layers.1", str(next(iter(block1._forward_hooks))))]
        assert lens.hooks.attached() == outer and hook_snapshot(model) == snap
    assert lens.hooks.attached() == []


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("order", ["steer_first", "capture_first"])
def test_a_second_lens_on_one_model_reads_the_first_lenses_edits(use_cache, order):
    """Edits run before reads across lenses of one model as within one, at q/k/v (through the
    attention registry and the cache's update) as at a module's output, whichever scope opened first."""
    model = tiny_model("llama", attn="sdpa")
    first, second = conceptlens.attach(model), conceptlens.attach(model)
    inputs = tiny_inputs("llama")
    sites = ["blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v", "blocks.1.attn.pattern", "blocks.0.resid_out"]
    g = torch.Generator().manual_seed(0)
    edits = [Add(torch.randn(4 * 8 if s.endswith(".q") else 2 * 8 if ".attn." in s else 32, generator=g), alpha=1.0,
                 site=s) for s in sites[:3] + sites[4:]]
    with first.capture(sites, keep_shape=True) as cap:
        clean, _ = cap.forward(**inputs, use_cache=use_cache)

    def read(lens, steer_lens):
        if order == "steer_first":
            with steer_lens.steer(*edits, positions=slice(1, 3)), lens.capture(sites, keep_shape=True) as cap:
                return cap.forward(**inputs, use_cache=use_cache)[0]
        with lens.capture(sites, keep_shape=True) as cap, steer_lens.steer(*edits, positions=slice(1, 3)):
            return cap.forward(**inputs, use_cache=use_cache)[0]

    own, other = read(first, first), read(second, first)
    reverse = read(first, second)  # the later lens steers, the earlier one reads
    for site in sites:
        assert not torch.equal(own[site], clean[site]), site
        assert torch.equal(other[site], own[site]), site
        assert torch.equal(reverse[site], own[site]), site
