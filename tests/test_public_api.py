"""The public API is visible to dir() and tab completion although it is imported lazily."""

from __future__ import annotations

import rlcompleter
import subprocess
import sys

import conceptlens


def test_dir_lists_the_lazy_api_and_every_listed_name_resolves():
    names = dir(conceptlens)
    assert set(conceptlens.__all__) <= set(names)
    assert {"attach", "Lens", "ConceptSet", "models", "data", "steering", "describe", "report"} <= set(names)
    for name in names:
        assert getattr(conceptlens, name) is not None, name
    assert conceptlens.ConceptSet.__name__ == "ConceptSet" and callable(conceptlens.attach)


def test_tab_completion_offers_the_lazy_names():
    complete = rlcompleter.Completer({"conceptlens": conceptlens}).complete
    offered = []
    while (found := complete("conceptlens.Co", len(offered))) is not None:
        offered.append(found)
    assert offered == ["conceptlens.ConceptSet("]
    assert complete("conceptlens.att", 0) == "conceptlens.attach("


def test_dir_imports_nothing_heavy():
    code = "import sys, conceptlens; dir(conceptlens); print('transformers' in sys.modules, 'torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]
