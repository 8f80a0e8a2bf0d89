"""How often `on_engine_failure="restart"` may restart the ranks, and how long it waits first.

A world that fails again at once (a bad GPU, a rank that cannot start) must not be restarted in
a tight loop, nor forever: like systemd's StartLimitBurst / StartLimitIntervalSec, at most
`max_restarts` restarts within any `window_s`; the next failure in the window exits, so that a
supervisor sees it. Restarts after the first in the window wait 1, 2, 4, ... seconds (at most
`MAX_BACKOFF_S`), like Kubernetes' crash-loop back-off; failures older than the window are
forgotten, so a server that fails once a day always restarts at once.
"""

from __future__ import annotations

from collections import deque

MAX_BACKOFF_S = 30.0


class RestartBudget:
    def __init__(self, max_restarts: int, window_s: float) -> None:
        self.max_restarts, self.window_s = max_restarts, window_s
        self._restarts: deque[float] = deque()

    def next_delay(self, now: float) -> float | None:
        """Seconds to wait before restarting after a failure at `now`, or None: the budget is
        spent, exit. Calling it counts the restart."""
        while self._restarts and now - self._restarts[0] >= self.window_s:
            self._restarts.popleft()
        if len(self._restarts) >= self.max_restarts:
            return None
        earlier = len(self._restarts)
        self._restarts.append(now)
        return 0.0 if earlier == 0 else min(MAX_BACKOFF_S, 2.0 ** (earlier - 1))

    def describe(self) -> str:
        return f"{self.max_restarts} restart(s) within {self.window_s:g} s"
