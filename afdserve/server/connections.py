"""uvicorn's h11 protocol with guards on connections, which uvicorn lacks:

- a deadline on every request head, keep-alive ones included (`head_timeout_s`): uvicorn's
  keep-alive timeout starts only after a response and any byte cancels it;
- a head over `max_head_bytes`, counted as it arrives, is a 431 and a close (h11's own bound
  holds only while the head is incomplete in its buffer);
- connection slots (slots.py), taken when a connection opens, before its path is read: slow
  connections are shed first, so /health and well-behaved clients keep theirs;
- framing RFC 9112 (6.1) refuses and h11 lets through (Content-Length with Transfer-Encoding,
  Transfer-Encoding on HTTP/1.0), and what h11 refuses itself: a 400 in OpenAI's shape, then a
  close;
- a response sent before its request's body arrived (401, 413, 408) ends the connection, or a
  client trickling the body would keep it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from afdserve.server.options import ServeOptions
from afdserve.server.protocol import error_body
from afdserve.server.slots import ConnectionSlots

_HEAD_END = b"\r\n\r\n"
_READING = (h11.IDLE, h11.SEND_BODY)  # h11's states of a client that still owes its request
SHED_GRACE_S = 1.0  # slots.py: how long a new connection may read before the share counts it


def framing_problem(request: h11.Request) -> str | None:
    """What RFC 9112 makes a 400 in a request head h11 accepted, or None."""
    names = [name for name, _ in request.headers]
    if b"transfer-encoding" in names:
        if b"content-length" in names:
            return "request framing: both Content-Length and Transfer-Encoding (RFC 9112, 6.1)"
        if request.http_version < b"1.1":
            return "request framing: Transfer-Encoding in an HTTP/1.0 request (RFC 9112, 6.1)"
    return None


class StrictH11(h11.Connection):
    """h11's server side, which also refuses framing_problem's requests; `refusal` says why the
    last request was refused (h11's own reason, or ours)."""

    refusal = "request: not valid HTTP/1.1"

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:
            self.refusal = f"request: not valid HTTP/1.1 ({str(e)[:200]})"
            raise
        if isinstance(event, h11.Request):
            problem = framing_problem(event)
            if problem is not None:
                self.refusal = problem
                raise h11.RemoteProtocolError(problem, 400)  # uvicorn: send_400_response
        return event


def _error_response(status: int, reason: bytes, message: str) -> bytes:
    body = json.dumps(error_body(status, message)).encode()
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n%s" % (status, reason, len(body), body)
    )


class GuardedH11(H11Protocol):
    head_timeout_s = 10.0
    max_head_bytes = 64 * 1024
    slots = ConnectionSlots(None, None, None, SHED_GRACE_S)  # one per server: guarded_h11
    on_shed: Callable[[str], None] = staticmethod(lambda reason: None)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = StrictH11(h11.SERVER, self.max_head_bytes)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes, self._head_tail = 0, b""
        super().connection_made(transport)
        host = self.client[0] if self.client else ""  # a Unix socket's clients: one address
        self._close(self.slots.admit(self, host, self.loop.time()))
        if not transport.is_closing():
            self._arm_head_timer()

    def _close(self, shed: list[tuple[Any, str]]) -> None:
        for conn, reason in shed:
            conn.transport.close()
            self.on_shed(reason)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_expired)

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            if not self._count_head(data):
                return
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the head is complete
                self._head_bytes, self._head_tail = 0, b""
                if self._head_timer is not None:
                    self._head_timer.cancel()
                    self._head_timer = None
        else:
            super().data_received(data)
        if self.conn.their_state not in _READING:
            self.slots.stop_reading(self)

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
        message = f"request head: larger than this server's limit of {self.max_head_bytes} bytes"
        self.transport.write(_error_response(431, b"Request Header Fields Too Large", message))
        self.transport.close()
        return False

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 (or StrictH11) refused: OpenAI's error body, with
        the reason, instead of its plain text."""
        self.transport.write(_error_response(400, b"Bad Request", self.conn.refusal))
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.SEND_BODY:
            self.transport.close()  # answered before its body arrived: do not read the rest
            return
        if self.conn.their_state is h11.IDLE or self.conn.their_state is h11.DONE:
            self._arm_head_timer()  # the next head has the same deadline as the first
        if self.conn.their_state is h11.IDLE:
            now = self.loop.time()
            self.slots.start_reading(self, now)
            self._close(self.slots.enforce_share(now))

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        # The connection is the WebSocket protocol's from here on: this one's connection_lost
        # will not run, so its slot is given back now.
        self.slots.release(self)
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self.slots.release(self)
        super().connection_lost(exc)


def guarded_h11(
    options: ServeOptions, on_shed: Callable[[str], None] = lambda reason: None
) -> type[GuardedH11]:
    """The protocol class to give uvicorn.Config(http=...): one per server (its own slots).
    `on_shed(reason)` counts each connection closed for want of a slot."""
    slots = ConnectionSlots(
        options.max_connections,
        options.reading_connections,
        options.max_connections_per_client,
        SHED_GRACE_S,
    )
    fields = {
        "head_timeout_s": options.header_timeout_s,
        "max_head_bytes": options.max_header_bytes,
        "slots": slots,
        "on_shed": staticmethod(on_shed),
    }
    return type("GuardedH11", (GuardedH11,), fields)
