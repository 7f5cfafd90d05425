"""The near-tie comparison of greedy replies (tests/helpers/near_ties.py) rejects what it must."""

from __future__ import annotations

from pathlib import Path

import pytest

from near_ties import NEAR_TIE_NATS, assert_greedy_agree

REPLY = [(" Paris", -0.1, {" Paris": -0.1, " Lyon": -3.0}),
         (".", -4.40, {".": -4.40, "!": -4.60, "?": -6.0})]


def test_equal_replies_and_a_first_difference_at_a_near_tie_pass():
    assert_greedy_agree(REPLY, list(REPLY))
    assert_greedy_agree(REPLY, [REPLY[0], ("!", -4.60, {})])


@pytest.mark.parametrize("other, reason", [
    ([(" Lyon", -3.0, {})], "by 2.900 nats"),  # a wide margin is a real difference
    ([REPLY[0], (" and", -9.0, {})], "not among"),  # not even an alternative
    ([REPLY[0]], "stops at token 1"),  # one reply ends early
])
def test_a_real_difference_fails(other, reason):
    with pytest.raises(AssertionError, match=reason):
        assert_greedy_agree(REPLY, other)


def test_the_bound_is_what_the_docs_state():
    docs = (Path(__file__).resolve().parents[1] / "docs" / "exactness.md").read_text()
    assert f"within **{NEAR_TIE_NATS} nats**" in docs
