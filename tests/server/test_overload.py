"""Overload and bad input against a real `afdserve serve` (colocated, one running sequence at a
time so that "waiting" is deterministic): large bodies and prompts are refused before any
tokenizer runs while /health stays fast, the waiting bound answers 503 + Retry-After, invalid
Unicode is a 400, and the counters equal what the test did. In-process: error bodies carry no
traceback, the per-request timeout, the log rate limit."""

from __future__ import annotations

import asyncio
import json
import logging
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from afdserve import LLM
from afdserve.server.limits import Admission, ConcurrencyLimit
from afdserve.server.logs import RateLimit
from afdserve.server.options import ServeOptions
from afdserve.server.protocol import APIError
from afdserve.server.serve import build_app

from .conftest import SERVED_NAME, ServerProcess, free_port, marked_pids, start_cli_server
from .test_reliability import clean, counters

BODY_LIMIT = 4_000_000
PROMPT_CHARS = 3_000_000  # above what the tokenizer does in well under a second
HEADER_TIMEOUT_S = 1.0
CONNECTIONS = 8
WAITING_TOKENS = 64
REJECTED = 'afdserve_requests_rejected_total{"reason": "%s"}'
ABORTED = "afdserve_requests_aborted_total{}"
WAITING = "afdserve_waiting_requests{}"


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_cli_server(
        tmp_path_factory.mktemp("busy"),
        free_port(),
        "--topology",
        "colocated",
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        "2",
        "--max-waiting-tokens",
        str(WAITING_TOKENS),
        "--max-request-body-bytes",
        str(BODY_LIMIT),
        "--max-prompt-chars",
        str(PROMPT_CHARS),
        "--header-timeout",
        str(HEADER_TIMEOUT_S),
        "--limit-concurrency",
        str(CONNECTIONS),
    )
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()
        assert marked_pids(srv.marker) == []


class HealthProbe:
    """Polls /health in a thread; `slowest` is the longest answer it saw."""

    def __init__(self, url: str) -> None:
        self.url, self.slowest, self.statuses = url, 0.0, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            self.statuses.add(httpx.get(f"{self.url}/health", timeout=30).status_code)
            self.slowest = max(self.slowest, time.monotonic() - start)
            time.sleep(0.02)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def test_large_input_is_refused_and_never_stalls_health(busy: ServerProcess) -> None:
    """A 10 MB body is a 413 and a 3.5 M-character prompt a 400, both before tokenizing; a
    2.4 M-character prompt is tokenized (about 2 s of tokenizer time on this machine) in a
    worker thread and then refused for its length. /health answers fast throughout."""
    before = counters(busy.url)
    url = f"{busy.url}/v1/completions"
    with HealthProbe(busy.url) as probe:
        time.sleep(0.2)
        start = time.monotonic()
        big = httpx.post(url, json={"prompt": "x" * 10_000_000, "max_tokens": 1}, timeout=60)
        big_s = time.monotonic() - start
        start = time.monotonic()
        long = httpx.post(url, json={"prompt": "y" * 3_500_000, "max_tokens": 1}, timeout=60)
        long_s = time.monotonic() - start
        tokenized = httpx.post(url, json={"prompt": "y " * 1_200_000}, timeout=120)
        time.sleep(0.2)
    assert big.status_code == 413 and "body" in big.json()["error"]["message"], big.text
    assert long.status_code == 400 and long.json()["error"]["param"] == "prompt", long.text
    assert "characters" in long.json()["error"]["message"]
    assert tokenized.status_code == 400 and "prompt" in tokenized.json()["error"]["message"]
    assert big_s < 5 and long_s < 5, (big_s, long_s)
    assert probe.statuses == {200} and probe.slowest < 1.0, probe.slowest
    after = counters(busy.url)
    for reason in ("body_too_large", "prompt_too_large"):
        assert after[REJECTED % reason] - before[REJECTED % reason] == 1


def wait_for(condition, seconds: float = 60) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_waiting_bound_503_with_retry_after_and_exact_counters(busy: ServerProcess) -> None:
    before = counters(busy.url)
    url = f"{busy.url}/v1/completions"
    long = {"prompt": "Hello", "max_tokens": 480, "ignore_eos": True, "stream": True}
    short = {"prompt": "Hi", "max_tokens": 4, "temperature": 0.0}
    with ThreadPoolExecutor(2) as pool:
        with httpx.stream("POST", url, json=long, timeout=120) as running:
            lines = (line for line in running.iter_lines() if line)
            assert next(lines).startswith("data: {")  # it runs: the only sequence allowed
            waiting = [pool.submit(httpx.post, url, json=short, timeout=120) for _ in range(2)]
            assert wait_for(lambda: counters(busy.url)[WAITING] == 2)
            refused = httpx.post(url, json=short, timeout=30)
        # leaving the block closes the stream: the running request is aborted
        answers = [w.result(timeout=120) for w in waiting]
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "overloaded"
    assert [a.status_code for a in answers] == [200, 200]
    assert wait_for(lambda: counters(busy.url)[ABORTED] - before[ABORTED] == 1, 30)
    after = counters(busy.url)
    assert after[REJECTED % "waiting_requests"] - before[REJECTED % "waiting_requests"] == 1
    assert after[ABORTED] - before[ABORTED] == 1
    assert after[WAITING] == 0 and after["afdserve_waiting_tokens{}"] == 0


def test_waiting_tokens_bound_on_a_live_server(busy: ServerProcess) -> None:
    """With one sequence running and a 40-token prompt waiting, a 30-token prompt would bring
    the waiting prompt tokens to 70 > 64: 503; a 20-token one (60) is admitted. The byte-level
    tokenizer makes a prompt of N ASCII characters N tokens."""
    before = counters(busy.url)
    url = f"{busy.url}/v1/completions"
    long = {"prompt": "Hello", "max_tokens": 480, "ignore_eos": True, "stream": True}

    def prompt(n: int) -> dict:
        return {"prompt": "a" * n, "max_tokens": 2, "temperature": 0.0}

    with ThreadPoolExecutor(2) as pool:
        with httpx.stream("POST", url, json=long, timeout=120) as running:
            lines = (line for line in running.iter_lines() if line)
            assert next(lines).startswith("data: {")
            first = pool.submit(httpx.post, url, json=prompt(40), timeout=120)
            assert wait_for(lambda: counters(busy.url)["afdserve_waiting_tokens{}"] == 40)
            refused = httpx.post(url, json=prompt(30), timeout=30)
            second = pool.submit(httpx.post, url, json=prompt(20), timeout=120)
            assert wait_for(lambda: counters(busy.url)["afdserve_waiting_tokens{}"] == 60)
        answers = [first.result(timeout=120), second.result(timeout=120)]
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
    assert "max_waiting_tokens=64" in refused.json()["error"]["message"]
    assert [a.status_code for a in answers] == [200, 200]
    after = counters(busy.url)
    assert after[REJECTED % "waiting_tokens"] - before[REJECTED % "waiting_tokens"] == 1
    assert wait_for(lambda: counters(busy.url)["afdserve_waiting_tokens{}"] == 0)


def test_invalid_unicode_is_a_400(busy: ServerProcess) -> None:
    headers = {"content-type": "application/json"}
    cases = [
        ("/v1/completions", b'{"prompt": "hi \\ud800", "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}',
            "messages",
        ),
        ("/v1/completions", b'{"prompt": "\xff\xfe bytes", "max_tokens": 2}', None),
        ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    ]
    for path, raw, param in cases:
        r = httpx.post(f"{busy.url}{path}", content=raw, headers=headers, timeout=30)
        assert r.status_code == 400, (raw, r.text)
        assert "error" in r.json() and (param is None or r.json()["error"]["param"] == param)
    ok = httpx.post(f"{busy.url}/v1/completions", json={"prompt": "héllo ✓", "max_tokens": 2})
    assert ok.status_code == 200


def test_connections_without_a_request_head_are_closed(busy: ServerProcess) -> None:
    """Silent and slow (half a head) connections are closed after --header-timeout, so they
    cannot pile up until the server runs out of file descriptors."""
    silent = socket.create_connection(("127.0.0.1", busy.port), timeout=10)
    slow = socket.create_connection(("127.0.0.1", busy.port), timeout=10)
    with silent, slow:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        assert silent.recv(1024) == b"" and slow.recv(1024) == b""
        closed_after = time.monotonic() - start
    assert HEADER_TIMEOUT_S - 0.5 < closed_after < HEADER_TIMEOUT_S + 4, closed_after
    assert httpx.get(f"{busy.url}/health", timeout=10).status_code == 200


def test_connections_beyond_the_limit_are_closed_at_once(busy: ServerProcess) -> None:
    """The cap is --limit-concurrency plus the reading share (a quarter of it); one connection
    beyond it closes one of the silent ones at once (slots.py), the others wait for the head
    deadline."""
    socks = [
        socket.create_connection(("127.0.0.1", busy.port), timeout=10)
        for _ in range(CONNECTIONS + CONNECTIONS // 4 + 1)
    ]
    start = time.monotonic()
    try:
        closed_after = []
        with selectors.DefaultSelector() as selector:
            for sock in socks:
                selector.register(sock, selectors.EVENT_READ)
            while len(closed_after) < len(socks) and time.monotonic() - start < 15:
                for key, _ in selector.select(timeout=1):
                    assert key.fileobj.recv(1024) == b""  # type: ignore[union-attr]
                    closed_after.append(time.monotonic() - start)
                    selector.unregister(key.fileobj)
    finally:
        for sock in socks:
            sock.close()
    assert len(closed_after) == len(socks), closed_after
    assert min(closed_after) < 0.5 * HEADER_TIMEOUT_S, closed_after  # the oldest, at the cap
    assert max(closed_after) < HEADER_TIMEOUT_S + 4, closed_after  # the others: silent
    assert httpx.get(f"{busy.url}/health", timeout=10).status_code == 200


def test_requests_beyond_the_concurrency_limit_get_an_openai_503() -> None:
    refused: list[int] = []
    release = asyncio.Event()

    async def slow_app(scope: dict, receive: object, send: object) -> None:
        await release.wait()

    limit = ConcurrencyLimit(
        slow_app,
        limit=2,
        retry_after_s=3,
        exempt=("/health",),
        on_refused=lambda: refused.append(1),
    )

    async def call(path: str) -> list[dict]:
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        await limit({"type": "http", "path": path}, None, send)
        return sent

    async def scenario() -> tuple[list[dict], list[dict]]:
        running = [asyncio.ensure_future(call("/v1/completions")) for _ in range(2)]
        await asyncio.sleep(0.01)
        over = await call("/v1/completions")
        probe = asyncio.ensure_future(call("/health"))  # exempt: it waits like the others
        await asyncio.sleep(0.01)
        release.set()
        await asyncio.gather(*running, probe)
        return over, probe.result()

    over, probe = asyncio.run(scenario())
    assert over[0]["status"] == 503 and (b"retry-after", b"3") in over[0]["headers"]
    assert json.loads(over[1]["body"])["error"]["type"] == "service_unavailable"
    assert probe == [] and refused == [1] and limit.active == 0


# ----- in-process -----


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM() as engine:
        yield engine


def test_internal_errors_carry_no_traceback(llm: LLM, monkeypatch, caplog) -> None:
    from afdserve.server import convert

    def broken(*_args: object) -> None:
        raise ValueError(f"cannot read {Path(__file__)}: secret")

    monkeypatch.setattr(convert, "completion_prompts", broken)
    options = ServeOptions(served_model_name=SERVED_NAME)
    with TestClient(build_app(llm, options), raise_server_exceptions=False) as http:
        r = http.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_server_error"
    assert clean(r.text) and "secret" not in r.text, r.text
    assert "secret" in caplog.text  # the log keeps it


def test_request_timeout_is_a_504_and_an_abort(llm: LLM) -> None:
    options = ServeOptions(served_model_name=SERVED_NAME, request_timeout_s=0.3)
    body = {"prompt": "Hello", "max_tokens": 480, "ignore_eos": True}
    with TestClient(build_app(llm, options)) as http:
        start = time.monotonic()
        r = http.post("/v1/completions", json=body)
        took = time.monotonic() - start
        metrics = http.get("/metrics").text
    assert r.status_code == 504 and "timed out" in r.json()["error"]["message"], r.text
    assert took < 5, took
    assert "afdserve_requests_aborted_total 1.0" in metrics


def test_admission_counts_tokens_and_releases_them() -> None:
    admission = Admission(max_requests=None, max_tokens=10, retry_after_s=2)
    admission.admit([[1] * 8])
    with pytest.raises(APIError) as refused:
        admission.admit([[1] * 3])
    assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "2"}
    admission.started(8)
    admission.admit([[1] * 30])  # alone, a long prompt may always wait
    assert (admission.requests, admission.tokens) == (1, 30)


def test_repeated_log_lines_are_rate_limited() -> None:
    limit = RateLimit(window_s=60, burst=5)
    record = logging.LogRecord(
        "asyncio", logging.ERROR, __file__, 1, "accept failed: %s", ("Too many open files",), None
    )
    assert sum(limit.filter(record) for _ in range(1000)) == 5
    other = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "other", (), None)
    assert limit.filter(other)
    info = logging.LogRecord(
        "afdserve.server", logging.INFO, __file__, 1, "request %s", ("r",), None
    )
    assert all(limit.filter(info) for _ in range(1000))  # one line per request is not a flood


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("on_engine_failure", "retry", "('exit', 'restart')"),
        ("drain_timeout_s", -1, "seconds >= 0"),
        ("max_waiting_requests", 0, "an integer > 0, or none"),
        ("max_request_body_bytes", 1.5, "an integer > 0"),
        ("request_timeout_s", 0, "seconds > 0, or none"),
        ("max_restarts", -1, "an integer >= 0"),
        ("max_restarts", 1.5, "an integer >= 0"),
        ("restart_window_s", 0, "seconds > 0"),
        ("tool_call_parser", "xml", "('hermes', 'qwen3_coder', 'deepseek_v3', 'kimi_k2')"),
        ("enable_auto_tool_choice", True, "a tool_call_parser"),
    ],
)
def test_serve_options_name_the_field_the_value_and_what_is_allowed(
    field: str, value: object, allowed: str
) -> None:
    with pytest.raises(ValueError) as error:
        ServeOptions(**{field: value})
    assert f"ServeOptions.{field}={value!r}" in str(error.value) and allowed in str(error.value)
