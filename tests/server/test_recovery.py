"""Requests survive a rank failure (on_engine_failure="restart"): real `afdserve serve` worlds
(2A1F over gloo), real streaming clients. A rank is killed (SIGKILL) or stopped (SIGSTOP) under
concurrent streams; every stream pauses and then goes on, and its text, token for token, equals
an undisturbed run of the same requests (greedy and seeded) on the same server. A request that
arrives while the world is down is held and served too. Only the failed rank is replaced: the
surviving ranks keep their processes (same pids) and their weights (each says, in the RankReady
of the new world generation, that its process loaded weights once). When the world cannot be
rebuilt that way (no rank survived; one that does not leave the broken world) it restarts whole.
Also: every 503 says Retry-After.

CI runs one cell (8 streams, the FFN rank killed); the wider matrix (each kind of rank, both
signals, 8 and 32 streams) is @pytest.mark.slow.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from afdserve import LLM
from afdserve.server.app import create_app
from afdserve.server.options import ServeOptions
from afdserve.server.serve import build_app

from .conftest import (
    STARTUP_DEADLINE_S,
    ServerProcess,
    alive,
    child_pids,
    free_port,
    marked_pids,
    metrics,
    rank_pids,
    start_cli_server,
)

HEARTBEAT_S = 4.0  # short, but not so short that a busy 2-core machine trips it
MAX_TOKENS = 240  # long enough that every stream is still running when the rank fails


def bodies(count: int) -> list[dict]:
    """Half greedy, half seeded sampling; distinct prompts."""
    out = []
    for i in range(count):
        body = {"prompt": f"Story {i}:", "max_tokens": MAX_TOKENS, "ignore_eos": True}
        if i % 2:
            body.update(temperature=0.9, top_p=0.95, seed=1000 + i)
        else:
            body.update(temperature=0.0)
        out.append(body)
    return out


class Stream:
    """One streaming completion: its text, its error lines, when its first token came."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.text = ""
        self.errors: list[str] = []
        self.finish: str | None = None
        self.first = threading.Event()

    def run(self, url: str, body: dict) -> Stream:
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=300
        ) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if not line or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    self.errors.append(line)
                    continue
                choice = chunk["choices"][0]
                self.text += choice["text"]
                self.finish = choice["finish_reason"] or self.finish
                self.first.set()
        return self


def stream_all(url: str, requests: list[dict]) -> tuple[list[Stream], ThreadPoolExecutor, list]:
    streams = [Stream() for _ in requests]
    pool = ThreadPoolExecutor(len(requests))
    futures = [pool.submit(s.run, url, body) for s, body in zip(streams, requests)]
    return streams, pool, futures


def health(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.TransportError:
        return None


def value(server: ServerProcess, name: str) -> float:
    return sum(v for (sample, _), v in metrics(server).items() if sample == name)


@pytest.fixture(scope="module")
def restarting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_cli_server(
        tmp_path_factory.mktemp("recovery"),
        free_port(),
        "--topology",
        "2A1F",
        "--heartbeat-timeout",
        str(HEARTBEAT_S),
        "--on-engine-failure",
        "restart",
        "--max-restarts",
        "20",
        "--enable-log-requests",
    )  # the per-request resume line
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()
        assert marked_pids(srv.marker) == [], srv.log()[-3000:]


def fail_a_rank_under_streams(
    srv: ServerProcess, victim: int, sig: signal.Signals, count: int
) -> None:
    requests = bodies(count)
    undisturbed, pool, futures = stream_all(srv.url, requests)
    for future in futures:
        future.result(timeout=300)
    pool.shutdown()
    assert all(s.status == 200 and not s.errors for s in undisturbed)
    late = {"prompt": "Late:", "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    late_want = httpx.post(f"{srv.url}/v1/completions", json=late, timeout=120).json()

    resumes_before = value(srv, "afdserve_request_resumes_total")
    recoveries_before = value(srv, "afdserve_recovery_seconds_count")
    old = rank_pids(srv.proc.pid)
    log_before = len(srv.log())
    streams, pool, futures = stream_all(srv.url, requests)
    for s in streams:
        assert s.first.wait(120), srv.log()[-3000:]
    assert not any(s.finish for s in streams), "a stream finished before the rank failed"
    failed_at = time.monotonic()
    os.kill(old[victim], sig)
    deadline = failed_at + 60
    while health(srv.url) == 200:  # until the failure is seen (the heartbeat, for SIGSTOP)
        assert time.monotonic() < deadline, "the failure was not detected"
        time.sleep(0.05)
    detected_after = time.monotonic() - failed_at
    # A request arriving while the world is down waits for the new one.
    late_got = httpx.post(f"{srv.url}/v1/completions", json=late, timeout=300)
    for future in futures:
        future.result(timeout=300)
    pool.shutdown()

    assert late_got.status_code == 200, late_got.text
    assert late_got.json()["choices"][0]["text"] == late_want["choices"][0]["text"]
    for i, (got, want) in enumerate(zip(streams, undisturbed)):
        assert got.status == 200 and not got.errors, (i, got.errors)
        assert got.finish == "length"
        assert got.text == want.text, (i, requests[i])
    assert value(srv, "afdserve_request_resumes_total") - resumes_before == count
    assert value(srv, "afdserve_recovery_seconds_count") - recoveries_before == 1
    assert "resumed 1 time(s) after engine failures" in srv.log()
    assert not alive(old[victim])  # the stopped rank included
    check_only_the_victim_was_replaced(srv, old, victim, srv.log()[log_before:])
    if sig == signal.SIGSTOP:
        role = "attention" if victim < 2 else "FFN"
        assert f"{role} rank {victim} stopped" in srv.log()
        assert detected_after < HEARTBEAT_S + 6, detected_after
    assert health(srv.url) == 200


def check_only_the_victim_was_replaced(
    srv: ServerProcess, old: dict[int, int], victim: int, log: str
) -> None:
    """The survivors run on in their processes and joined the new world generation with the
    weights they had (their RankReady says their process loaded weights once); the victim's
    rank runs in a new process. `log`: the server's log since the failure."""
    now = rank_pids(srv.proc.pid)
    assert sorted(now) == sorted(old), (old, now)
    assert now[victim] != old[victim]
    assert "rebuilt the world in" in log, log[-3000:]
    assert "restarting the ranks in" not in log, log[-3000:]  # not the whole world
    for rank, pid in old.items():
        if rank == victim:
            continue
        assert now[rank] == pid, (rank, old, now)
        assert re.search(
            rf"rank {rank} \(pid {pid}\) joined world generation \d+; weights "
            rf"loaded 1 time\(s\) by this process",
            log,
        ), log[-3000:]
    assert re.search(rf"rank {victim} \(pid {now[victim]}\) joined world generation \d+", log), log[
        -3000:
    ]
    assert f"rank(s) [{victim}] replaced" in log, log[-3000:]


def test_streams_survive_an_ffn_rank_killed(restarting: ServerProcess) -> None:
    fail_a_rank_under_streams(restarting, victim=2, sig=signal.SIGKILL, count=8)


@pytest.mark.slow
def test_streams_survive_an_attention_rank_killed(restarting: ServerProcess) -> None:
    fail_a_rank_under_streams(restarting, victim=0, sig=signal.SIGKILL, count=8)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("victim", "sig"),
    [
        (0, signal.SIGKILL),
        (1, signal.SIGSTOP),
        (2, signal.SIGSTOP),
        (0, signal.SIGSTOP),
        (2, signal.SIGKILL),
    ],
)
def test_32_streams_survive_each_kind_of_rank_failure(
    restarting: ServerProcess, victim: int, sig: signal.Signals
) -> None:
    fail_a_rank_under_streams(restarting, victim, sig, count=32)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "victim"),
    [
        (("--topology", "1A2F", "--ffn-expert-parallel"), 2),  # the expert group is rebuilt too
        (("--topology", "2A1F", "--control-plane", "gloo"), 0),  # the gloo control plane
    ],
)
def test_other_worlds_replace_only_the_killed_rank(
    tmp_path: Path, world: tuple[str, ...], victim: int
) -> None:
    srv = start_cli_server(
        tmp_path,
        free_port(),
        *world,
        "--heartbeat-timeout",
        str(HEARTBEAT_S),
        "--on-engine-failure",
        "restart",
        "--enable-log-requests",
    )
    try:
        srv.wait_healthy()
        fail_a_rank_under_streams(srv, victim, signal.SIGKILL, count=4)
    finally:
        srv.stop()
        assert marked_pids(srv.marker) == [], srv.log()[-3000:]


# ----- Retry-After -----


def test_every_503_says_retry_after() -> None:
    """Loading, restarting, failed: each 503 (on /health and on work) carries Retry-After."""
    options = ServeOptions(served_model_name="tiny", retry_after_s=7)
    body = {"prompt": "hi", "max_tokens": 2}
    with TestClient(create_app(options)) as http:
        for path, send in (("/health", http.get), ("/v1/completions", None)):
            r = send(path) if send else http.post(path, json=body)
            assert r.status_code == 503 and r.headers["retry-after"] == "7", r.text
            assert "loading" in r.json()["error"]["message"]
        http.app.state.server.detach("rank 2 failed")
        for r in (http.get("/health"), http.post("/v1/completions", json=body)):
            assert r.status_code == 503 and r.headers["retry-after"] == "7", r.text
            assert "restarting (rank 2 failed)" in r.json()["error"]["message"]
    llm = LLM()
    try:
        with TestClient(build_app(llm, options)) as http:
            assert http.post("/v1/completions", json=body).status_code == 200
            llm.engine.core_client.shutdown()  # the engine breaks under the engine thread
            deadline = time.monotonic() + 30
            while http.get("/health").status_code == 200:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            for r in (http.get("/health"), http.post("/v1/completions", json=body)):
                assert r.status_code == 503 and r.headers["retry-after"] == "7", r.text
                assert "engine failed" in r.json()["error"]["message"]
    finally:
        llm.shutdown()


def standby_pids(pid: int) -> list[int]:
    """The server's rank processes that wait for the next world (RANK set, not yet named)."""
    running = set(rank_pids(pid).values())
    found = []
    for child in child_pids(pid, recursive=False):
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if child not in running and alive(child) and any(e.startswith(b"RANK=") for e in environ):
            found.append(child)
    return found


def test_a_failed_restart_is_retried_within_the_budget(tmp_path: Path) -> None:
    """Every rank is killed: no rank survives to rebuild the world around, so it restarts
    whole. The first restart fails (the standby processes it starts on were killed); the server
    tries again within --max-restarts, on freshly started processes, instead of exiting 1."""
    srv = start_cli_server(
        tmp_path,
        free_port(),
        "--topology",
        "1A1F",
        "--on-engine-failure",
        "restart",
        "--max-restarts",
        "3",
    )
    try:
        srv.wait_healthy()
        old = rank_pids(srv.proc.pid)
        deadline = time.monotonic() + STARTUP_DEADLINE_S
        while len(standby := standby_pids(srv.proc.pid)) < 2:
            assert time.monotonic() < deadline, srv.log()[-3000:]
            time.sleep(0.1)
        for pid in standby:
            os.kill(pid, signal.SIGKILL)
        os.kill(old[1], signal.SIGKILL)
        os.kill(old[0], signal.SIGKILL)
        while "restarted in" not in srv.log():
            assert srv.proc.poll() is None, srv.log()[-3000:]
            assert time.monotonic() < deadline, srv.log()[-3000:]
            time.sleep(0.25)
        assert health(srv.url) == 200
        log = srv.log()
        assert "the restart failed" in log and log.count("restarting the ranks in") == 2, log
        assert "could not rebuild the world around its surviving ranks" in log, log
        assert not [pid for pid in old.values() if alive(pid)]
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0.0}
        answer = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
    finally:
        srv.stop()
        assert marked_pids(srv.marker) == []


# ----- the engine thread's recovery, in-process -----


def test_the_engine_thread_holds_resumes_and_bounds_resumes() -> None:
    """A real engine thread over one-process engines: a request in flight when its engine breaks
    is held, one submitted during the outage is held too; both go on when a new engine is handed
    over (the held one's tokens equal an undisturbed run); when that engine breaks as well, the
    request resumed once already fails with an error naming max_request_resumes=1."""
    from afdserve import SamplingParams
    from afdserve.server.engine_loop import EngineFailure, EngineLoop, Recovery, Resumed

    first, second = LLM(), LLM()
    try:
        prompt = first.encode_prompt("Hello")
        short = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        want = second.generate([prompt], short)[0].outputs[0].token_ids
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        want_long = second.generate([prompt], long)[0].outputs[0].token_ids
        events: dict[str, list] = {"long": [], "held": []}
        resumed, recovered = [], []
        loop = EngineLoop(
            first.engine,
            recovery=Recovery(
                resume=True,
                max_resumes=1,
                on_resume=lambda: resumed.append(1),
                on_recovered=recovered.append,
            ),
        ).start()
        loop.submit("long", prompt, long, events["long"].append).result(10)

        def wait_for(check, what: str) -> None:
            deadline = time.monotonic() + 60
            while not check():
                assert time.monotonic() < deadline, what
                time.sleep(0.01)

        wait_for(lambda: events["long"], "a first token")
        first.engine.core_client.shutdown()  # the engine breaks under the thread
        wait_for(lambda: loop.error is not None, "the failure")
        assert loop.holds_requests and not loop.healthy
        loop.submit("held", prompt, short, events["held"].append).result(10)
        time.sleep(0.2)
        assert not events["held"]  # held: no engine to run it
        loop.resume_on(second.engine)
        assert loop.healthy
        wait_for(lambda: events["held"] and events["held"][-1].finished, "the held request")
        assert events["held"][-1].token_ids == want
        assert [e for e in events["long"] if isinstance(e, Resumed)] and resumed == [1]
        assert len(recovered) == 1 and recovered[0] > 0
        before = len(events["long"])
        wait_for(lambda: len(events["long"]) > before + 2, "tokens after the resume")
        second.engine.core_client.shutdown()
        wait_for(lambda: isinstance(events["long"][-1], EngineFailure), "the second failure")
        message = events["long"][-1].message
        assert "failed 2 time(s) under it (max_request_resumes=1)" in message, message
        outputs = [e for e in events["long"] if not isinstance(e, Resumed | EngineFailure)]
        tokens = [t for out in outputs for t in out.new_token_ids]
        assert tokens == outputs[-1].token_ids  # no token lost or repeated across the move
        assert tokens == want_long[: len(tokens)]  # and the same as an undisturbed run
        loop.stop()
    finally:
        first.shutdown()
        second.shutdown()


def test_a_rebuilt_world_on_a_fresh_process_gives_the_same_tokens() -> None:
    """A real 1A1F world without standby processes: the FFN rank is killed under a request; the
    repair spawns a fresh process for it, the attention rank rejoins in its own process with the
    weights it had (its RankReady: generation 1, one load), and the rebuilt world gives the
    tokens the first world gave for the same greedy request."""
    from afdserve import SamplingParams

    llm = LLM(topology="1A1F")
    try:
        client = llm.engine.core_client
        client.repairable = True  # as under on_engine_failure="restart"
        procs = list(client.world.procs)
        prompt = llm.encode_prompt("Hello")
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        want = llm.generate([prompt], params)[0].outputs[0].token_ids
        llm.engine.add_request("long", prompt, SamplingParams(max_tokens=400, ignore_eos=True))
        llm.engine.step()
        os.kill(procs[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        with pytest.raises(Exception, match="rank"):
            while True:
                llm.engine.step()
                assert time.monotonic() < deadline
        llm.engine.take_progress("long")
        assert client.repair() is True
        now = client.world.procs
        assert now[0] is procs[0] and procs[0].poll() is None
        assert now[1].pid != procs[1].pid and now[1].poll() is None
        assert [(r.generation, r.loads) for r in client.ready.values()] == [(1, 1), (1, 1)]
        assert llm.generate([prompt], params)[0].outputs[0].token_ids == want
    finally:
        llm.shutdown()


def test_a_world_without_a_known_culprit_is_not_rebuilt() -> None:
    """A real 1A1F world judged failed by the frontend (as the heartbeat judges a silent world)
    while every rank process runs on: which rank hangs is unknown, so none is replaced; the
    repair gives up at once, kills every rank, and the caller restarts the world whole."""
    llm = LLM(topology="1A1F")
    try:
        client = llm.engine.core_client
        assert client.repairable is False  # serve's on_engine_failure="restart" turns it on
        client.repairable = True
        procs = list(client.world.procs)
        client._fail()  # what step() does on a failure it detected
        assert client.broken and all(proc.poll() is None for proc in procs)
        began = time.monotonic()
        assert client.repair() is False
        assert time.monotonic() - began < 10.0
        assert client.closed and all(proc.poll() is not None for proc in procs)
    finally:
        llm.shutdown()


def test_a_survivor_that_fails_during_the_rebuild_restarts_the_world_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real 2A1F world: the FFN rank is killed, and attention rank 0 is stopped just after
    the frontend killed the failed ranks, while the world is rebuilt around it: the repair gives
    up (the world restarts whole) and leaves no rank process behind."""
    from afdserve import SamplingParams
    from afdserve.afd.ranks.world import RankWorld

    llm = LLM(topology="2A1F")
    try:
        client = llm.engine.core_client
        client.repairable = True
        procs = list(client.world.procs)
        kill_failed, calls = RankWorld.kill_failed, []

        def and_stop_a_survivor(world: RankWorld) -> set[int]:
            failed = kill_failed(world)
            calls.append(failed)
            if len(calls) == 2:  # the rebuild's (the first is the failure's, in step)
                os.kill(procs[0].pid, signal.SIGSTOP)
            return failed

        monkeypatch.setattr(RankWorld, "kill_failed", and_stop_a_survivor)
        prompt = llm.encode_prompt("Hello")
        llm.engine.add_request("r", prompt, SamplingParams(max_tokens=200, ignore_eos=True))
        os.kill(procs[2].pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        with pytest.raises(Exception, match="rank"):
            while True:
                llm.engine.step()
                assert time.monotonic() < deadline
        assert client.broken
        assert client.repair() is False
        assert calls == [{2}, {2}]
        assert client.closed and all(proc.poll() is not None for proc in procs)
    finally:
        llm.shutdown()
