"""uvicorn's h11 protocol with guards on connections, which uvicorn lacks:

- a deadline on every request head, the first and each one after it on a keep-alive connection
  (`head_timeout_s`): uvicorn's keep-alive timeout starts only after a response and any byte
  cancels it, so a client that sends nothing, or its headers a byte at a time, would hold a file
  descriptor for as long as it likes.
- a head larger than `max_head_bytes`, counted as the bytes arrive, is a 431 and the connection
  closes. h11's own bound (`h11_max_incomplete_event_size`) applies only while the head is
  incomplete in its buffer, so a head that arrives whole in one read passed it at twice the size.
- a cap on open connections per client address (`max_per_client`) and on all of them
  (`max_connections`); one beyond either is closed at once. (Requests in progress are bounded in
  the app, limits.ConcurrencyLimit, with an OpenAI-style body, not uvicorn's plain-text 503.)
- a response sent before its request's body has arrived (a 401, a 413, a 408) ends the
  connection: otherwise h11 reads on, and a client that trickles the body keeps the connection.
  The body's own deadline is limits.BodyLimit's.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from afdserve.server.protocol import error_body

_HEAD_END = b"\r\n\r\n"


class GuardedH11(H11Protocol):
    head_timeout_s = 10.0
    max_head_bytes = 64 * 1024
    max_connections: int | None = None
    max_per_client: int | None = None
    per_client: dict[str, int] = {}  # open connections by client host; one dict per server

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes, self._head_tail = 0, b""
        self._host: str | None = None
        super().connection_made(transport)
        host = self.client[0] if self.client else None
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            transport.close()
            return
        if host is not None:
            if (
                self.max_per_client is not None
                and self.per_client.get(host, 0) >= self.max_per_client
            ):
                transport.close()
                return
            self._host = host
            self.per_client[host] = self.per_client.get(host, 0) + 1
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_expired)

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        reading_head = self.conn.their_state is h11.IDLE
        if reading_head:
            if not self._count_head(data):
                return
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the head is complete
                self._head_bytes, self._head_tail = 0, b""
                if self._head_timer is not None:
                    self._head_timer.cancel()
                    self._head_timer = None
            return
        super().data_received(data)

    def _count_head(self, data: bytes) -> bool:
        """Count this chunk's bytes up to the end of the head; False (and a 431 sent) when the
        head is over the bound."""
        seen = self._head_tail + data
        end = seen.find(_HEAD_END)
        if end >= 0:
            size = self._head_bytes + end + len(_HEAD_END) - len(self._head_tail)
        else:
            size = self._head_bytes + len(data)
            self._head_bytes, self._head_tail = size, seen[-(len(_HEAD_END) - 1) :]
        if size <= self.max_head_bytes:
            return True
        body = json.dumps(
            error_body(
                431, f"request head: larger than this server's limit of {self.max_head_bytes} bytes"
            )
        ).encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        self.transport.close()
        return False

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self.transport.close()  # answered before its body arrived: do not read the rest
            return
        if self.conn.their_state is h11.IDLE or self.conn.their_state is h11.DONE:
            self._arm_head_timer()  # the next head has the same deadline as the first

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self._host is not None:
            left = self.per_client[self._host] - 1
            if left:
                self.per_client[self._host] = left
            else:
                del self.per_client[self._host]  # no entry per address ever seen
            self._host = None
        super().connection_lost(exc)


def guarded_h11(
    head_timeout_s: float,
    max_head_bytes: int,
    max_connections: int | None,
    max_per_client: int | None,
) -> type[GuardedH11]:
    """The protocol class to give uvicorn.Config(http=...): one per server (its own counts)."""
    fields = {
        "head_timeout_s": head_timeout_s,
        "max_head_bytes": max_head_bytes,
        "max_connections": max_connections,
        "max_per_client": max_per_client,
        "per_client": {},
    }
    return type("GuardedH11", (GuardedH11,), fields)
