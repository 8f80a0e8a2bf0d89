"""uvicorn's h11 protocol with two guards on connections, which uvicorn lacks:

- a deadline on a connection's first request head. uvicorn's keep-alive timeout starts only after
  a response, so a client that connects and sends nothing (or its headers a byte at a time)
  holds a file descriptor for as long as it likes; tens of thousands of them end in "Too many
  open files" for everyone. Such a connection is closed once `head_timeout_s` passed.
- a cap on open connections: one beyond `max_connections` is closed at once. (uvicorn's
  limit_concurrency would answer its requests with a plain-text 503; requests in progress are
  bounded in the app instead, limits.ConcurrencyLimit, with an OpenAI-style body.)
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class GuardedH11(H11Protocol):
    head_timeout_s = 10.0
    max_connections: int | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            transport.close()
            return
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_expired)

    def _head_expired(self) -> None:
        if self.cycle is None and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)


def guarded_h11(head_timeout_s: float, max_connections: int | None) -> type[GuardedH11]:
    """The protocol class to give uvicorn.Config(http=...)."""
    fields = {"head_timeout_s": head_timeout_s, "max_connections": max_connections}
    return type("GuardedH11", (GuardedH11,), fields)
