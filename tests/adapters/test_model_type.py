"""`Adapter.model_type` is the model's `config.model_type`; `family`, its old name, still answers
with a DeprecationWarning."""

from __future__ import annotations

import pytest

import conceptlens
from tests.conftest import tiny_model


def test_model_type_is_the_config_s_and_family_is_a_deprecated_alias():
    model = tiny_model("gpt2")
    lens = conceptlens.attach(model)
    assert lens.adapter.model_type == model.config.model_type == "gpt2"
    assert "model_type='gpt2'" in repr(lens)
    with pytest.warns(DeprecationWarning, match="model_type"):
        assert lens.adapter.family == "gpt2"
