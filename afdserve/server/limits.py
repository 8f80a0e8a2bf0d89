"""What the frontend refuses before the engine sees a request: bodies larger than a bound (413,
before the body is read) or slower than a deadline (408), and new work beyond a bound on what
already waits (503 + Retry-After). A refusal before the body was read carries
`Connection: close`, and the connection ends (connections.py).

"Waiting" is counted in the frontend: an engine request is waiting from its admission until its
first token (or its end). That includes the ranks' scheduler queue and the time the request takes
to get there, and it is exact, unlike the ranks' own gauges, which arrive a step late.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from afdserve.server.protocol import APIError, ChatMessage, error_body, overloaded


class Admission:
    """Bounds on engine requests without a first token, and on their prompt tokens. Used from the
    event loop only."""

    def __init__(
        self, max_requests: int | None, max_tokens: int | None, retry_after_s: int
    ) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.retry_after_s = retry_after_s
        self.requests = 0
        self.tokens = 0

    def check(self, requests: int) -> None:
        """Before tokenizing: is there room for `requests` more?"""
        if self.max_requests is not None and self.requests + requests > self.max_requests:
            raise overloaded(
                f"the server is overloaded: {self.requests} requests are waiting "
                f"(max_waiting_requests={self.max_requests}); retry later",
                self.retry_after_s,
                "waiting_requests",
            )

    def admit(self, prompts: list[list[int]]) -> None:
        """Count these engine requests as waiting, or refuse them all."""
        self.check(len(prompts))
        tokens = sum(len(p) for p in prompts)
        if self.max_tokens is not None and self.tokens + tokens > self.max_tokens:
            if self.tokens > 0:  # one request alone may always wait, however long
                raise overloaded(
                    f"the server is overloaded: {self.tokens} prompt tokens are waiting "
                    f"(max_waiting_tokens={self.max_tokens}); retry later",
                    self.retry_after_s,
                    "waiting_tokens",
                )
        self.requests += len(prompts)
        self.tokens += tokens

    def started(self, prompt_tokens: int) -> None:
        """One engine request got its first token, finished, or was dropped."""
        self.requests -= 1
        self.tokens -= prompt_tokens


def _send_error(status: int, message: str, extra: tuple = ()) -> Callable:
    async def respond(send: Callable) -> None:
        body = json.dumps(error_body(status, message)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"connection", b"close"),
            (b"content-length", str(len(body)).encode()),
            *extra,
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return respond


class BodyLimit:
    """ASGI middleware: a body over `max_bytes` is a 413, from its Content-Length before any of
    it is read, or as soon as the bytes received pass the bound; a body not all there within
    `timeout_s` of its head is a 408 (a client that never sends the rest of a chunked body, or
    sends it a byte at a time, would otherwise hold its connection and a request slot for as
    long as it likes). The body is read here in full (handlers read it in full anyway) and
    handed on unchanged."""

    def __init__(
        self, app: Any, max_bytes: int, timeout_s: float, on_refused: Callable[[str], None]
    ) -> None:
        self.app, self.max_bytes, self.on_refused = app, max_bytes, on_refused
        self.timeout_s = timeout_s

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        message = f"body: larger than this server's limit of {self.max_bytes} bytes"
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            self.on_refused("body_too_large")
            await _send_error(413, message)(send)
            return
        chunks, size = [], 0
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                event = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                self.on_refused("body_timeout")
                late = f"body: not received within this server's limit of {self.timeout_s:g} s"
                await _send_error(408, late)(send)
                return
            if event["type"] != "http.request":  # the client left while sending
                return
            chunks.append(event.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                self.on_refused("body_too_large")
                await _send_error(413, message)(send)
                return
            if not event.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then disconnects, as the handlers expect

        await self.app(scope, replay, send)


class ConcurrencyLimit:
    """ASGI middleware: beyond `limit` HTTP requests at once, a 503 with Retry-After in OpenAI's
    shape (uvicorn's own limit_concurrency answers in plain text, so it is not used). Probes
    (`exempt` paths) always pass: a liveness probe must not fail because the server is busy."""

    def __init__(
        self,
        app: Any,
        limit: int,
        retry_after_s: int,
        exempt: tuple[str, ...],
        on_refused: Callable[[], None],
    ) -> None:
        self.app, self.limit, self.exempt, self.on_refused = app, limit, exempt, on_refused
        self.retry_after = (b"retry-after", str(retry_after_s).encode())
        self.active = 0

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("path") in self.exempt:
            await self.app(scope, receive, send)
            return
        if self.active >= self.limit:
            self.on_refused()
            message = f"the server is overloaded: {self.active} requests in progress; retry later"
            await _send_error(503, message, (self.retry_after,))(send)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


def check_text(value: Any, param: str) -> None:
    """A string that is not valid Unicode (a lone UTF-16 surrogate, from a JSON escape such as
    "\\ud800") is a 400 naming the field; tokenizers fail on it in unhelpful ways."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            message = f"{param}: not valid Unicode at character {e.start} (a lone surrogate)"
            raise APIError(400, message, param) from None
    elif isinstance(value, (list, tuple)):
        for item in value:
            check_text(item, param)


def check_prompt_chars(value: Any, max_chars: int, param: str) -> None:
    """Strings longer than `max_chars` in all are a 400, before any tokenizer runs."""
    total = 0
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if isinstance(item, str):
            total += len(item)
    if total > max_chars:
        raise APIError(
            400,
            f"{param}: {total} characters cannot fit in the context "
            f"(this server accepts at most {max_chars} characters of prompt)",
            param,
            rejected="prompt_too_large",
        )


def check_messages(messages: list[ChatMessage], max_chars: int) -> None:
    """A chat's texts, checked as a prompt's are, before the chat template runs."""
    texts = [m.text() for m in messages]
    check_text(texts, "messages")
    check_prompt_chars(texts, max_chars, "messages")
