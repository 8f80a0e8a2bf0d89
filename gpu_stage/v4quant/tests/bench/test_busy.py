"""The busy time the 1A1F bench reports: a step's span less the time spent in waits."""

from __future__ import annotations

import pytest

from afdserve.bench.decode_p2p import busy_ns


def test_busy_is_the_span_less_the_waits():
    # start 100, waits 150->400 and 450->1000, end 1100: span 1000, waiting 250 + 550.
    assert busy_ns([100, 150, 400, 450, 1000, 1100]) == (1000, 200)


def test_a_step_without_waits_is_all_busy():
    assert busy_ns([5, 25]) == (20, 20)


@pytest.mark.parametrize("marks", [[], [1], [1, 2, 3]])
def test_stamps_that_do_not_pair_up_are_refused(marks):
    with pytest.raises(ValueError, match="pairs around waits"):
        busy_ns(marks)
