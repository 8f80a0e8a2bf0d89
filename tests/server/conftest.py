"""A real `run_server` in a subprocess (bundled tiny model), shared by the module, and the process
bookkeeping the shutdown tests need: every process a test server starts carries a marker in its
environment, so that a test finds them all, ranks whose parent is gone included."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

SERVED_NAME = "tiny"
MARKER = "AFDSERVE_TEST_SERVER"  # in the environment of every process a test server starts
STARTUP_DEADLINE_S = 240.0  # a 2A1F start on a busy 2-core machine
SERVER_CODE = """
import json, sys
from afdserve.llm import LLM
from afdserve.server.serve import ServeOptions, run_server

options = ServeOptions(host="127.0.0.1", port=int(sys.argv[1]), **json.loads(sys.argv[3]))
sys.exit(run_server(lambda: LLM(topology=sys.argv[2]), options))
"""


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    marker: str
    log_path: Path
    health_seen: set[int] = field(default_factory=set)  # /health statuses while starting

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_DEADLINE_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                self.health_seen.add(httpx.get(f"{self.url}/health", timeout=2).status_code)
                if 200 in self.health_seen:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise AssertionError(f"/health not 200 in {STARTUP_DEADLINE_S:.0f} s:\n{self.log()}")

    def exit_code(self, timeout_s: float) -> int:
        """The server's exit code once it exits; still running after `timeout_s` fails the
        test with the end of its log (what it was doing)."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"server still running after {timeout_s:g} s:\n{self.log()[-4000:]}"
            ) from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in marked_pids(self.marker):  # whatever failed, leave no rank behind
            os.kill(pid, signal.SIGKILL)


def start_server(
    tmp_path: Path, port: int, topology: str = "2A1F", **options: object
) -> ServerProcess:
    """`options` are ServeOptions fields; the served name is SERVED_NAME unless they say."""
    options = {"served_model_name": SERVED_NAME, "uvicorn_log_level": "warning", **options}
    marker = uuid.uuid4().hex
    log_path = tmp_path / f"server-{port}.log"
    # One intra-op thread per process: three ranks and the tests share two cores.
    env = dict(os.environ, OMP_NUM_THREADS="1", **{MARKER: marker})
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVER_CODE, str(port), topology, json.dumps(options)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    return ServerProcess(proc, port, marker, log_path)


def start_cli_server(tmp_path: Path, port: int, *args: str) -> ServerProcess:
    """`afdserve serve ARGS` as an operator runs it (python -m afdserve.cli, so that the
    PYTHONPATH of the tests decides which afdserve runs)."""
    marker = uuid.uuid4().hex
    log_path = tmp_path / f"cli-server-{port}.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", **{MARKER: marker})
    # --served-model-name takes several names (vLLM's nargs="+"): the --port after it ends them.
    command = [
        sys.executable,
        "-m",
        "afdserve.cli",
        "serve",
        "--served-model-name",
        SERVED_NAME,
        "--port",
        str(port),
        *args,
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    return ServerProcess(proc, port, marker, log_path)


def metrics(server: ServerProcess) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def wait_until_in_engine(server: ServerProcess, count: int, deadline_s: float = 30.0) -> None:
    """Until `count` requests are in the engine (running or waiting). A test that fails a rank
    under requests waits for this first: a request still on its way in when the engine fails is
    refused with 503, one in the engine is failed with 500, and under load either can happen."""
    labels = (("model_name", SERVED_NAME),)
    deadline = time.monotonic() + deadline_s
    while True:
        seen = metrics(server)
        inside = (
            seen[("vllm:num_requests_running", labels)]
            + seen[("vllm:num_requests_waiting", labels)]
        )
        if inside >= count:
            return
        assert time.monotonic() < deadline, f"{inside} of {count} requests in the engine"
        time.sleep(0.05)


def rank_pids(pid: int) -> dict[int, int]:
    """rank -> pid of the rank processes of the server `pid`'s running world (RANK in their
    environment; a rank names itself afdserve-rankN once its world starts, which tells it from
    a standby process of the next world)."""
    ranks = {}
    for child in child_pids(pid, recursive=False):
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            if not Path(f"/proc/{child}/comm").read_text().startswith("afdserve-rank"):
                continue
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"RANK=") and alive(child):
                ranks[int(item[5:])] = child
    return ranks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int, recursive: bool = True) -> set[int]:
    """The children (or every descendant) of `pid`, from /proc/<pid>/task/*/children."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = {int(p) for p in (task / "children").read_text().split()}
            except OSError:
                continue
            if recursive:
                todo.extend(kids - found)
            found |= kids
    return found


def alive(pid: int) -> bool:
    """Running; a zombie has exited (only its exit status is left to collect)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def marked_pids(marker: str) -> list[int]:
    """Live processes started by the test server with this marker, orphans included."""
    needle = f"{MARKER}={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return [pid for pid in pids if alive(pid)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(tmp_path_factory.mktemp("server"), free_port())
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()
