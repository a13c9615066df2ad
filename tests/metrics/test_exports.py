"""`from conceptlens.metrics import NAME` yields the function even where a submodule has the same name."""

import importlib
import types

import conceptlens.metrics as metrics


def test_functions_named_like_their_module_stay_functions_after_the_submodule_loads():
    for name in ("gauge_audit", "faithfulness", "similarity"):
        module = importlib.import_module(f"conceptlens.metrics.{name}")  # registers the submodule
        assert isinstance(module, types.ModuleType)
        from_package = getattr(metrics, name)
        assert callable(from_package) and not isinstance(from_package, types.ModuleType)
        assert from_package is getattr(module, name)
    ns: dict = {}
    exec("from conceptlens.metrics import gauge_audit, faithfulness", ns)
    assert not isinstance(ns["gauge_audit"], types.ModuleType)
    assert not isinstance(ns["faithfulness"], types.ModuleType)


def test_every_exported_name_resolves():
    for name in metrics.__all__:
        assert not isinstance(getattr(metrics, name), types.ModuleType), name
