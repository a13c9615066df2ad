"""Fault-injection tests; `one_line_error` is their shared check."""

import pytest


def one_line_error(kind, fn, *names: str) -> str:
    """Run fn, expect `kind`, and check its message is one line naming every one of `names`."""
    with pytest.raises(kind) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message, message
    for name in names:
        assert name in message, message
    return message
