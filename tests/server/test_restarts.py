"""The restart budget of on_engine_failure="restart": how many restarts, how long each waits."""

from __future__ import annotations

from afdserve.server.restarts import MAX_BACKOFF_S, RestartBudget


def test_back_off_doubles_and_the_budget_ends_it() -> None:
    budget = RestartBudget(max_restarts=3, window_s=600)
    assert [budget.next_delay(t) for t in (0.0, 1.0, 3.0)] == [0.0, 1.0, 2.0]
    assert budget.next_delay(10.0) is None  # the fourth failure within 600 s


def test_failures_older_than_the_window_are_forgotten() -> None:
    budget = RestartBudget(max_restarts=2, window_s=60)
    assert budget.next_delay(0.0) == 0.0
    assert budget.next_delay(30.0) == 1.0
    assert budget.next_delay(59.0) is None
    assert budget.next_delay(95.0) == 0.0  # both earlier restarts are more than 60 s old
    assert budget.next_delay(100.0) == 1.0


def test_back_off_is_capped() -> None:
    budget = RestartBudget(max_restarts=10, window_s=1e9)
    delays = [budget.next_delay(float(t)) for t in range(10)]
    assert delays == [
        0.0,
        1.0,
        2.0,
        4.0,
        8.0,
        16.0,
        MAX_BACKOFF_S,
        MAX_BACKOFF_S,
        MAX_BACKOFF_S,
        MAX_BACKOFF_S,
    ]
    assert budget.next_delay(10.0) is None


def test_no_restarts_allowed() -> None:
    assert RestartBudget(0, 600).next_delay(0.0) is None
