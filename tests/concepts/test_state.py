"""The state dataclasses of k-means, VQ, CLVQ and Deleuzian: `state()` is a copy, `load_state`
continues bit for bit, `state_dict` is the state's checkpoint layout, and nothing handed in or
out is changed by later updates."""

import copy
from dataclasses import asdict

import pytest

from tests.concepts.data.old_states import CASES, CUT, feed, make, stream
from tests.conftest import assert_same_state, roundtrip

OWN = [case for case in CASES if not case.startswith("sharded")]


@pytest.mark.parametrize("case", OWN)
def test_load_state_of_a_state_continues_bit_for_bit(case):
    chunks = stream(case)
    whole = feed(make(case), chunks)
    resumed = make(case)
    resumed.load_state(feed(make(case), chunks[:CUT]).state())
    feed(resumed, chunks[CUT:])
    assert_same_state(resumed.state_dict(), whole.state_dict())


@pytest.mark.parametrize("case", OWN)
def test_state_dict_is_the_states_checkpoint_layout(case):
    ext = feed(make(case), stream(case)[:CUT])
    assert type(ext.state()) is type(ext).State
    again = make(case)
    again.load_state(type(ext).State.from_dict(roundtrip(ext.state_dict())))
    assert_same_state(again.state_dict(), ext.state_dict())


@pytest.mark.parametrize("case", OWN)
def test_states_handed_in_or_out_are_not_changed_by_later_updates(case):
    chunks = stream(case)
    ext = feed(make(case), chunks[:CUT])
    given, taken = ext.state_dict(), ext.state()
    kept_given, kept_taken = copy.deepcopy(given), copy.deepcopy(taken)
    loaded = make(case)
    loaded.load_state_dict(given)
    feed(loaded, chunks[CUT:])
    feed(ext, chunks[CUT:])
    assert_same_state(given, kept_given)   # (b2b0d37's CLVQ: Adam counted its steps in the given dict)
    assert_same_state(asdict(taken), asdict(kept_taken))
