"""Hostile clients against a real `afdserve serve` (colocated, bundled model) over real sockets:

- slow heads from three client addresses, each connection reopened as soon as it is closed, at the
  connection cap: /health and completions from a fourth address are still answered;
- requests with 100,000 unknown fields, or fields named with a newline and a forged log line: a
  few kB of log in all, and no line of the log that a request wrote;
- a request framed two ways (Content-Length and Transfer-Encoding, two lengths, a coding other than
  chunked, ...): a 400, then the connection closes, so a request pipelined behind it is not served.

All of 127.0.0.0/8 is loopback on Linux: 127.0.0.2-4 (the flood) and 127.0.0.5 (the well-behaved
client) are four client addresses to the server."""

from __future__ import annotations

import asyncio
import json
import re
import resource
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from .conftest import ServerProcess, free_port, marked_pids, metrics, start_cli_server

FLOODERS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
CLIENT = "127.0.0.5"
LIMIT = 32  # --limit-concurrency of the module's server: its cap, scaled down from 1024
HEADER_TIMEOUT_S = 5.0
PROBES, COMPLETIONS = 25, 5
SLOW_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: "
SHED = "afdserve_connections_shed_total"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_cli_server(
        tmp_path_factory.mktemp("hostile"),
        free_port(),
        "--topology",
        "colocated",
        "--limit-concurrency",
        str(LIMIT),
        "--header-timeout",
        str(HEADER_TIMEOUT_S),
    )
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()
        assert marked_pids(srv.marker) == []


class SlowFlood:
    """`per_address` connections from each of FLOODERS, each sending a head a byte every
    `interval_s` and never ending it; a connection the server closes is opened again after
    `pause_s`, until stop(). Its own event loop, in a thread."""

    def __init__(self, port: int, per_address: int, interval_s: float = 0.5) -> None:
        self.port, self.per_address, self.interval_s = port, per_address, interval_s
        self.pause_s = 0.02
        self.opened = self.closed = self.open_now = self.most_open = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),))

    def __enter__(self) -> SlowFlood:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 2 * len(FLOODERS) * self.per_address + 256
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, want), hard))
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        self._loop.close()

    def wait_all_opened(self, deadline_s: float = 30.0) -> None:
        deadline = time.monotonic() + deadline_s
        while self.opened < len(FLOODERS) * self.per_address:
            assert time.monotonic() < deadline, (self.opened, self.closed)
            time.sleep(0.05)

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        self._ready.set()
        slots = [self._slot(a) for a in FLOODERS for _ in range(self.per_address)]
        await asyncio.gather(*slots)

    async def _slot(self, address: str) -> None:
        while not self._stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", self.port, local_addr=(address, 0)
                )
            except OSError:
                await asyncio.sleep(self.pause_s)
                continue
            self.opened += 1
            self.open_now += 1
            self.most_open = max(self.most_open, self.open_now)
            try:
                writer.write(SLOW_HEAD)
                while not self._stop.is_set():
                    try:
                        chunk = await asyncio.wait_for(reader.read(1024), self.interval_s)
                    except asyncio.TimeoutError:
                        writer.write(b"a")  # one more byte of a header that never ends
                        continue
                    if not chunk:
                        self.closed += 1
                        break
            except OSError:
                self.closed += 1
            finally:
                writer.close()
                self.open_now -= 1
            await asyncio.sleep(self.pause_s)


def _client(timeout_s: float) -> httpx.Client:
    """A client from CLIENT's address; a new one per request, so that each request needs a new
    connection, as a liveness probe's does."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=CLIENT), timeout=timeout_s)


def well_behaved(url: str) -> tuple[list[int], list[int], float]:
    """PROBES /health (2 s each, as a liveness probe's timeout), then COMPLETIONS completions:
    their statuses (0: no answer), and the slowest /health."""
    health, slowest = [], 0.0
    for _ in range(PROBES):
        start = time.monotonic()
        try:
            with _client(2.0) as http:
                health.append(http.get(f"{url}/health").status_code)
        except httpx.HTTPError:
            health.append(0)
        slowest = max(slowest, time.monotonic() - start)
        time.sleep(0.1)
    completions = []
    for _ in range(COMPLETIONS):
        try:
            with _client(30.0) as http:
                body = {"prompt": "Hello", "max_tokens": 4}
                completions.append(http.post(f"{url}/v1/completions", json=body).status_code)
        except httpx.HTTPError:
            completions.append(0)
    return health, completions, slowest


def _shed(server: ServerProcess) -> float:
    """Slow connections the server closed to make room (the share's and the cap's)."""
    seen = metrics(server)
    return sum(seen.get((SHED, (("reason", r),)), 0.0) for r in ("reading_share", "connection_cap"))


def flooded(server: ServerProcess, per_address: int, interval_s: float = 0.5) -> None:
    shed_before = _shed(server)
    with SlowFlood(server.port, per_address, interval_s) as flood:
        flood.wait_all_opened()
        time.sleep(1.5)  # the flood's first connections are old enough to be shed
        health, completions, slowest = well_behaved(server.url)
        opened, closed, most_open = flood.opened, flood.closed, flood.most_open
    print(
        f"flood {len(FLOODERS)}x{per_address}: opened {opened}, closed by the server {closed}, "
        f"most open at once {most_open}; /health {health.count(200)}/{PROBES} "
        f"(slowest {slowest:.2f} s), completions {completions.count(200)}/{COMPLETIONS}"
    )
    assert closed > 0 and most_open >= len(FLOODERS) * per_address // 2  # the flood was real
    assert health.count(200) >= PROBES - 2, health
    assert completions.count(200) >= COMPLETIONS - 1, completions
    assert _shed(server) > shed_before
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200


def test_slow_heads_from_three_addresses_leave_others_served(server: ServerProcess) -> None:
    """Three addresses open 4x the cap of slow connections between them."""
    flooded(server, per_address=4 * LIMIT // len(FLOODERS) + 1)


@pytest.mark.slow
def test_1100_slow_heads_from_three_addresses_leave_others_served(tmp_path) -> None:
    """The issue's probe at full size: 2A1F with the default limits (--limit-concurrency 1024,
    a reading share of 256), 1,100 slow heads a byte every 3 s from three addresses."""
    srv = start_cli_server(tmp_path, free_port(), "--topology", "2A1F")
    try:
        srv.wait_healthy()
        flooded(srv, per_address=1100 // len(FLOODERS) + 1, interval_s=3.0)
    finally:
        srv.stop()
    assert marked_pids(srv.marker) == []


# ----- the log -----


def _log_size(server: ServerProcess) -> int:
    return server.log_path.stat().st_size


def test_unknown_fields_leave_a_few_kb_of_log(server: ServerProcess) -> None:
    unknown = {f"field_{i}": 0 for i in range(100_000)}
    before = _log_size(server)
    with httpx.Client(timeout=60) as http:
        for _ in range(10):
            body = {"prompt": "Hello", "max_tokens": 1, **unknown}
            assert http.post(f"{server.url}/v1/completions", json=body).status_code == 200
        long_name = {"n" * 1_000_000: 0, "prompt": "Hello", "max_tokens": 1}
        assert http.post(f"{server.url}/v1/completions", json=long_name).status_code == 200
    grown = _log_size(server) - before
    print(f"11 requests with 100,000 unknown fields or a 1 MB name: {grown} bytes of log")
    assert grown <= 100_000, grown


FORGED = "ERROR 2025-01-01 00:00:00,000 afdserve.server: FORGED"


@pytest.mark.parametrize("separator", ["\n", "\r\n", "\r", "\u2028", "\x1b[2K\r"])
def test_a_field_name_cannot_forge_a_log_line(server: ServerProcess, separator: str) -> None:
    before = _log_size(server)
    body = {"prompt": "Hello", "max_tokens": 1, f"x{separator}{FORGED}": 1}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    with open(server.log_path, "rb") as f:
        f.seek(before)
        written = f.read().decode()
    lines = [line for line in written.splitlines() if "FORGED" in line]
    assert len(lines) == 1 and lines[0].startswith("WARNING "), written
    assert separator not in lines[0] and "\x1b" not in lines[0], lines


# ----- framing (RFC 9112, 6.1 and 6.3) -----

BODY = b'{"prompt": "Hello", "max_tokens": 1}'
CHUNKED = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
SMUGGLED = b"GET /v1/models?smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
FRAMINGS = {
    "content-length and chunked": b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n%s"
    % (len(CHUNKED), CHUNKED),
    "chunked and content-length": b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n"
    + CHUNKED,
    "two content-lengths": b"Content-Length: %d\r\nContent-Length: 5\r\n\r\n%s" % (len(BODY), BODY),
    "a content-length list": b"Content-Length: %d, 5\r\n\r\n%s" % (len(BODY), BODY),
    "gzip, chunked": b"Transfer-Encoding: gzip, chunked\r\n\r\n" + CHUNKED,
    "chunked twice": b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n" + CHUNKED,
    "a bad content-length": b"Content-Length: +%d\r\n\r\n%s" % (len(BODY), BODY),
    "two hosts": b"Host: y\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY),
}


def _exchange(port: int, request: bytes, within_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (b'<open>' at the end if it
    had not closed it within `within_s`)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(request)
        sock.settimeout(within_s)
        got, deadline = b"", time.monotonic() + within_s
        try:
            while time.monotonic() < deadline:
                chunk = sock.recv(65536)
                if not chunk:
                    return got
                got += chunk
        except TimeoutError:
            pass
        except ConnectionResetError:
            return got
    return got + b"<open>"


def _statuses(got: bytes) -> list[int]:
    """The status of each response in `got`, in order (each framed by its Content-Length)."""
    statuses = []
    while got.startswith(b"HTTP/1.1 "):
        head, _, rest = got.partition(b"\r\n\r\n")
        statuses.append(int(head.split(b" ", 2)[1]))
        length = re.search(rb"\r\ncontent-length: (\d+)", head, re.IGNORECASE)
        got = rest[int(length.group(1)) :] if length else b""
    return statuses


@pytest.mark.parametrize("framing", FRAMINGS)
def test_a_request_framed_two_ways_is_a_400_and_its_connection_closes(
    server: ServerProcess, framing: str
) -> None:
    version = b"HTTP/1.1"
    head = b"POST /v1/completions " + version + b"\r\nHost: x\r\nContent-Type: application/json\r\n"
    got = _exchange(server.port, head + FRAMINGS[framing] + SMUGGLED)
    assert _statuses(got) == [400] and not got.endswith(b"<open>"), got
    assert b"connection: close" in got.lower()
    error = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["type"] == "invalid_request_error", error


def test_chunked_in_http_1_0_is_a_400(server: ServerProcess) -> None:
    """RFC 9112 6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing."""
    request = (
        b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + CHUNKED
    )
    got = _exchange(server.port, request + SMUGGLED)
    assert _statuses(got) == [400] and not got.endswith(b"<open>"), got


def test_well_framed_requests_are_served_and_kept_alive(server: ServerProcess) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    for framing in (
        b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY),
        b"Transfer-Encoding: chunked\r\n\r\n" + CHUNKED,
    ):
        got = _exchange(server.port, head + framing + SMUGGLED, within_s=1.0)
        assert _statuses(got) == [200, 200] and got.endswith(b"<open>"), got
