"""uvicorn's h11 protocol with a deadline on a connection's first request head.

uvicorn's keep-alive timeout starts only after a response, so a client that connects and sends
nothing (or its headers a byte at a time) holds a file descriptor for as long as it likes; tens
of thousands of them end in "Too many open files" for everyone. Here such a connection is closed
once `head_timeout_s` passed without a complete request head.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeadTimeoutH11(H11Protocol):
    head_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_expired)

    def _head_expired(self) -> None:
        if self.cycle is None and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_timer.cancel()
        super().connection_lost(exc)


def h11_with_head_timeout(seconds: float) -> type[HeadTimeoutH11]:
    """The protocol class to give uvicorn.Config(http=...)."""
    return type("HeadTimeoutH11", (HeadTimeoutH11,), {"head_timeout_s": seconds})
