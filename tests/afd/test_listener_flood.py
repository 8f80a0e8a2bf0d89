"""The rank listener under a flood of silent connections (real sockets over loopback, the flood
in its own process: silent_flood.py): the flood costs the frontend no thread (one listener
thread runs every handshake), the flood is dropped at its deadline with a bounded number of log
lines, and real ranks get in while the flood is held open, a whole world of them included."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from afdserve import LLM
from afdserve.afd.ranks import channel as channel_module
from afdserve.afd.ranks.channel import RankListener, connect
from afdserve.afd.ranks.messages import Hello

from .conftest import GREEDY, colocated_tokens

FLOOD = 600
MAX_THREADS = 64
KEY = os.urandom(32)
FLOOD_SCRIPT = Path(__file__).with_name("silent_flood.py")


def _threads() -> int:
    """Threads of this process, as the kernel counts them."""
    return len(os.listdir("/proc/self/task"))


def _start_flood(address: tuple[str, int], renew: bool = False) -> subprocess.Popen:
    """The flood's process, once it holds FLOOD connections."""
    args = [sys.executable, str(FLOOD_SCRIPT), address[0], str(address[1]), str(FLOOD)]
    proc = subprocess.Popen(
        args + (["--renew"] if renew else []),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == f"held {FLOOD}", f"the flood did not start: {line!r}"
    return proc


def _stop_flood(proc: subprocess.Popen) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _wait_for(condition, within: float) -> None:
    deadline = time.monotonic() + within
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert condition()


@pytest.fixture(autouse=True)
def _needs_proc():
    if not Path("/proc/self/task").is_dir():
        pytest.skip("counts threads with /proc/self/task")


def test_a_flood_of_silent_peers_costs_no_thread_and_a_rank_still_gets_in(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger=channel_module.__name__)
    # Short, so the test waits little for the flood to be dropped (a rank in this process
    # answers in milliseconds), yet long enough that a loaded 2-core box accepts all FLOOD
    # connections before the first of them times out (at 2 s it did not, under load).
    monkeypatch.setattr(channel_module, "HANDSHAKE_TIMEOUT_S", 6.0)
    # One window for every rejection, however spread out the flood's acceptance was.
    monkeypatch.setattr(channel_module, "LOG_WINDOW_S", 10.0)
    listener = RankListener(("127.0.0.1", 0), KEY)
    flood = None
    try:
        before = _threads()
        flood = _start_flood(listener.address)
        _wait_for(lambda: listener.pending >= FLOOD, within=30)
        during = _threads()
        start = time.monotonic()
        rank = connect(listener.address, KEY)
        rank.send(Hello(1))
        got = listener.get(timeout=5)
        took = time.monotonic() - start
        print(f"threads: {before} before the flood, {during} with {FLOOD} silent peers pending")
        print(f"a rank got in {took * 1000:.0f} ms behind them")
        assert got is not None and got[0] == Hello(1)
        assert took < 2.0
        assert during <= MAX_THREADS and during <= before + 1
        _wait_for(lambda: listener.rejected >= FLOOD, within=30)
        assert listener.pending == 0

        def summed() -> int:
            # The first LOGGED_WARNINGS one by one, the rest counted at the end of the window.
            counted = [r.args[0] for r in caplog.records if "not logged one by one" in r.message]
            return len(caplog.records) - len(counted) + sum(counted)

        _wait_for(lambda: summed() >= FLOOD, within=30)
        print(f"log lines for {FLOOD} rejected peers: {len(caplog.records)}")
        assert len(caplog.records) <= channel_module.LOGGED_WARNINGS + 1
        assert summed() == FLOOD
        rank.close()
    finally:
        if flood is not None:
            _stop_flood(flood)
        listener.close()


class _KeyFileLine(logging.Handler):
    """Catches the frontend's "a fresh key was written to PATH" line: where ranks find the key."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.path: str | None = None
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "AFDSERVE_AUTHKEY_FILE=" in message:
            self.path = message.split("AFDSERVE_AUTHKEY_FILE=")[1].strip()
            self.seen.set()


def test_ranks_join_a_frontend_under_a_flood_and_its_key_file_goes_with_it(afd_models, monkeypatch):
    """The --frontend-address path with no key: the frontend writes a key file and listens; a
    flood of FLOOD silent peers (renewed as the frontend drops them) is held open while three
    ranks, given the key file, start and join. The world serves like the colocated engine, the
    frontend never runs more than MAX_THREADS threads, and after shutdown the key file is gone."""
    from afdserve.frontend.process import free_port

    monkeypatch.delenv("AFDSERVE_AUTHKEY", raising=False)
    monkeypatch.delenv("AFDSERVE_AUTHKEY_FILE", raising=False)
    frontend, master = free_port(), free_port()
    key_line = _KeyFileLine()
    world_log = logging.getLogger("afdserve.afd.ranks.world")
    world_log.addHandler(key_line)
    monkeypatch.setattr(world_log, "level", logging.INFO)
    most, sampling = {"threads": _threads(), "files": 0}, threading.Event()
    procs: list[subprocess.Popen] = []
    flood: list[subprocess.Popen] = []

    def sample() -> None:
        while not sampling.wait(0.02):
            most["threads"] = max(most["threads"], _threads())
            most["files"] = max(most["files"], len(os.listdir("/proc/self/fd")))

    def flood_then_ranks() -> None:
        if not key_line.seen.wait(timeout=60):
            return  # the frontend's start-up times out and says so
        flood.append(_start_flood(("127.0.0.1", frontend), renew=True))
        for rank in range(3):
            env = dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(master),
                WORLD_SIZE="3",
                RANK=str(rank),
                AFDSERVE_FRONTEND=f"127.0.0.1:{frontend}",
                AFDSERVE_AUTHKEY_FILE=str(key_line.path),
            )
            procs.append(
                subprocess.Popen([sys.executable, "-m", "afdserve.afd.ranks.worker"], env=env)
            )

    sampler = threading.Thread(target=sample, daemon=True)
    starter = threading.Thread(target=flood_then_ranks, daemon=True)
    model = afd_models["qwen3_moe"]
    prompts = [[3, 4, 5], [6, 7]]
    try:
        sampler.start()
        starter.start()
        with LLM(
            str(model), topology="2A1F", dtype="float32", frontend_address=f"127.0.0.1:{frontend}"
        ) as llm:
            got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
            assert key_line.path is not None and os.path.exists(key_line.path)
        starter.join(timeout=10)
        for p in procs:
            assert p.wait(timeout=30) == 0
    finally:
        sampling.set()
        world_log.removeHandler(key_line)
        starter.join(timeout=10)
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in flood:
            _stop_flood(p)
    print(f"frontend: at most {most['threads']} threads and {most['files']} open files")
    assert most["threads"] <= MAX_THREADS
    assert most["files"] >= FLOOD  # the flood was in: a descriptor for each silent peer
    assert got == colocated_tokens(model, prompts)
    assert not os.path.exists(key_line.path)
