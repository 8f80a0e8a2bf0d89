"""The reliability suite: real `afdserve serve` processes (2A1F over gloo, and colocated), a real
HTTP client, loopback only, every loop bounded. A rank killed (SIGKILL) or stopped (SIGSTOP)
under load, the drain on SIGTERM, overload and oversized input, error bodies and the counters
that must match what the test did. Each test stops what it started and checks that no process
is left (conftest.marked_pids).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from .conftest import (
    STARTUP_DEADLINE_S,
    ServerProcess,
    alive,
    free_port,
    marked_pids,
    rank_pids,
    start_cli_server,
    wait_until_in_engine,
)

HEARTBEAT_S = 4.0  # short, but not so short that a busy 2-core machine trips it
LONG = {"prompt": "Hello", "max_tokens": 480, "ignore_eos": True, "temperature": 0.0}
TRACE_MARKERS = ("Traceback", 'File "', ".py", "/afdserve/")


def health(url: str) -> int | None:
    """/health's status, or None when nothing answers."""
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.TransportError:
        return None


def clean(body: str) -> bool:
    return not any(marker in body for marker in TRACE_MARKERS)


def stream_lines(url: str, body: dict, first: threading.Event, lines: list[str]) -> None:
    """A streaming completion; sets `first` at the first token, collects every data line."""
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120
    ) as r:
        lines.append(f"status {r.status_code}")
        for line in r.iter_lines():
            if line:
                lines.append(line)
                first.set()


def counters(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        sample.name + json.dumps(sample.labels, sort_keys=True): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def stop(srv: ServerProcess) -> None:
    srv.stop()
    assert marked_pids(srv.marker) == [], srv.log()[-3000:]


# ----- a rank dies: the server exits non-zero -----


@pytest.mark.parametrize(
    ("victim", "sig", "within_s"),
    [
        (0, signal.SIGKILL, 5.0),  # an attention rank dies: seen at once
        (2, signal.SIGSTOP, HEARTBEAT_S + 4),  # the FFN rank hangs: seen by the heartbeat
    ],
)
def test_failed_rank_fails_requests_and_the_server_exits_1(
    tmp_path: Path, victim: int, sig: signal.Signals, within_s: float
) -> None:
    srv = start_cli_server(
        tmp_path,
        free_port(),
        "--topology",
        "2A1F",
        "--heartbeat-timeout",
        str(HEARTBEAT_S),
        "--on-engine-failure",
        "exit",
    )
    try:
        srv.wait_healthy()
        ranks = rank_pids(srv.proc.pid)
        assert sorted(ranks) == [0, 1, 2], ranks
        first, lines = threading.Event(), []
        with ThreadPoolExecutor(2) as pool:
            streaming = pool.submit(stream_lines, srv.url, LONG, first, lines)
            plain = pool.submit(httpx.post, f"{srv.url}/v1/completions", json=LONG, timeout=120)
            assert first.wait(60), srv.log()[-3000:]
            wait_until_in_engine(srv, 2)
            killed = time.monotonic()
            os.kill(ranks[victim], sig)
            answer = plain.result(timeout=60)
            failed_after = time.monotonic() - killed
            streaming.result(timeout=60)
        assert answer.status_code == 500, answer.text
        assert "rank" in answer.json()["error"]["message"] and clean(answer.text)
        if sig == signal.SIGSTOP:  # the stopped rank itself is named, not a rank waiting on it
            assert f"FFN rank {victim} stopped" in answer.json()["error"]["message"]
        assert lines[-1] == "data: [DONE]"
        assert "error" in json.loads(lines[-2].removeprefix("data: ")) and clean(lines[-2])
        assert failed_after < within_s, failed_after
        assert health(srv.url) != 200
        assert srv.proc.wait(30) == 1
        assert time.monotonic() - killed < 20
        assert "Traceback" in srv.log()  # the log keeps what the client was not shown
        assert not [pid for pid in ranks.values() if alive(pid)]
    finally:
        stop(srv)


# ----- a rank hangs: the server restarts its ranks, the stream goes on; then SIGTERM drains -----


@pytest.fixture(scope="module")
def restarting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_cli_server(
        tmp_path_factory.mktemp("restart"),
        free_port(),
        "--topology",
        "2A1F",
        "--heartbeat-timeout",
        str(HEARTBEAT_S),
        "--on-engine-failure",
        "restart",
        "--drain-timeout",
        "60",
    )
    try:
        srv.wait_healthy()
        yield srv
    finally:
        stop(srv)


@pytest.mark.parametrize(
    ("victim", "sig", "within_s", "says"),
    [
        (2, signal.SIGSTOP, HEARTBEAT_S + 4, "FFN rank 2 stopped"),  # the FFN rank hangs
        # then an attention rank of the new world dies; the FFN rank, cut off from it, may be
        # the one whose failure arrives first
        (0, signal.SIGKILL, 5.0, "rank"),
    ],
)
def test_failed_rank_is_detected_and_replaced(
    restarting: ServerProcess, victim: int, sig: signal.Signals, within_s: float, says: str
) -> None:
    """The failure is seen (/health 503) within `within_s`; the failed rank is replaced (the
    others keep their processes) and the stream, resumed on the rebuilt world, ends normally
    (tests/server/test_recovery.py checks its tokens)."""
    srv = restarting
    assert srv.proc.poll() is None, srv.log()[-5000:]
    old = rank_pids(srv.proc.pid)
    first, lines = threading.Event(), []
    with ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(stream_lines, srv.url, LONG, first, lines)
        assert first.wait(60), srv.log()[-3000:]
        stopped = time.monotonic()
        os.kill(old[victim], sig)
        while health(srv.url) == 200 and time.monotonic() < stopped + within_s + 5:
            time.sleep(0.05)
        failed_after = time.monotonic() - stopped
        streaming.result(timeout=STARTUP_DEADLINE_S)
    assert failed_after < within_s, failed_after
    # Only the failed rank is replaced (test_recovery.py checks the survivors kept their weights)
    assert says in srv.log() and "replacing the failed rank(s)" in srv.log()
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines), lines[-3:]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[1:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) > 1
    assert health(srv.url) == 200, srv.log()[-3000:]
    assert not alive(old[victim])  # the stopped rank included
    new = rank_pids(srv.proc.pid)
    assert sorted(new) == [0, 1, 2] and new[victim] != old[victim]
    assert all(new[rank] == pid for rank, pid in old.items() if rank != victim), (old, new)
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0.0}
    answer = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4


def test_a_world_that_keeps_failing_exhausts_the_restart_budget(tmp_path: Path) -> None:
    """--max-restarts 1: the first failure replaces the failed rank (the stream is resumed),
    the second (within the window) exits 1 with a line that says why, the stream held for a
    restart that will not come fails with the engine's error, and no rank is left behind."""
    srv = start_cli_server(
        tmp_path,
        free_port(),
        "--topology",
        "1A1F",
        "--on-engine-failure",
        "restart",
        "--max-restarts",
        "1",
    )
    try:
        srv.wait_healthy()
        for attempt in range(2):
            ranks = rank_pids(srv.proc.pid)
            first, lines = threading.Event(), []
            with ThreadPoolExecutor(1) as pool:
                streaming = pool.submit(stream_lines, srv.url, LONG, first, lines)
                assert first.wait(60), srv.log()[-3000:]
                os.kill(ranks[1], signal.SIGKILL)  # the FFN rank
                streaming.result(timeout=STARTUP_DEADLINE_S)
            if attempt == 0:
                assert not any('"error"' in line for line in lines), lines[-3:]
                deadline = time.monotonic() + STARTUP_DEADLINE_S
                while health(srv.url) != 200 and time.monotonic() < deadline:
                    assert srv.proc.poll() is None, srv.log()[-3000:]
                    time.sleep(0.25)
                assert health(srv.url) == 200, srv.log()[-3000:]
            else:
                assert "engine failed" in lines[-2], lines[-3:]
        assert srv.proc.wait(30) == 1
        assert "no restart left (1 restart(s) within 600 s)" in srv.log()
        assert srv.log().count("replacing the failed rank(s) in 0 s") == 1
    finally:
        stop(srv)


def test_sigterm_drains_in_flight_requests_then_stops_every_rank(
    restarting: ServerProcess,
) -> None:
    srv = restarting
    assert srv.proc.poll() is None, srv.log()[-5000:]
    ranks = rank_pids(srv.proc.pid)
    first, lines = threading.Event(), []
    # Long enough to be still in flight when the probes below go out, half a second after the
    # signal (48 tokens could finish by then, and the drained server is gone).
    body = LONG
    with ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(stream_lines, srv.url, body, first, lines)
        assert first.wait(60), srv.log()[-3000:]
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the signal is handled between two bytecodes of the main thread
        refused = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=10)
        probe = health(srv.url)
        streaming.result(timeout=120)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "shutting down" in refused.json()["error"]["message"]
    assert probe == 503
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[1:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert srv.proc.wait(60) == 0
    assert "drained" in srv.log()
    assert not [pid for pid in ranks.values() if alive(pid)]


def test_drain_timeout_cuts_off_what_is_left(tmp_path: Path) -> None:
    srv = start_cli_server(tmp_path, free_port(), "--topology", "colocated", "--drain-timeout", "1")
    try:
        srv.wait_healthy()
        first, lines = threading.Event(), []
        body = {**LONG, "n": 8}  # far more than a second of work
        with ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(stream_lines, srv.url, body, first, lines)
            assert first.wait(60), srv.log()[-3000:]
            signalled = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            streaming.result(timeout=60)
            ended_after = time.monotonic() - signalled
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert "shutting down" in error["message"], error
        assert 0.8 < ended_after < 8, ended_after
        assert srv.proc.wait(30) == 0
        assert "drain timeout" in srv.log()
    finally:
        stop(srv)
