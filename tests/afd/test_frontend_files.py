"""A frontend's files in the temp directory (afd/ranks/frontend_files.py: the rendezvous store
directory of a spawned world, the key file written for ranks started elsewhere), with real
processes: the files of a frontend killed with SIGKILL are removed by the next frontend that
starts, those of a live one are kept, and a frontend stopped by SIGINT, by SIGTERM through the
server's drain, or by a failed start leaves none."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from afdserve.afd.ranks import frontend_files
from afdserve.afd.ranks.frontend_files import KEY_PREFIX, STORE_PREFIX, remove_stale

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="tells live owners from gone ones by /proc"
)

OWNER_CODE = """
import sys
from afdserve.afd.ranks.frontend_files import owner_tag
print(owner_tag(), flush=True)
sys.stdin.read()
"""


def _owner_process() -> tuple[subprocess.Popen, str]:
    """A process that prints the owner part of its files' names, then waits on stdin."""
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER_CODE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def test_only_files_of_owners_provably_gone_are_removed(tmp_path):
    """Gone: an owner that exited, one killed and not yet reaped (a zombie), one whose pid now
    runs another process (another start time). Kept: a live owner's, one of another pid
    namespace (a container sharing /tmp: its pids are not ours to look up), names without an
    owner (older afdserve), a symlink, and an entry of the wrong kind."""
    live, live_tag = _owner_process()
    exited, exited_tag = _owner_process()
    zombie, zombie_tag = _owner_process()
    try:
        _end(exited)
        zombie.kill()  # not waited for: a zombie until this test ends
        deadline = time.monotonic() + 10
        while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        pid, start, namespace = live_tag.split("-")
        reused = f"{pid}-{int(start) + 1}-{namespace}"
        dead_pid, dead_start, _ = exited_tag.split("-")
        elsewhere = f"{dead_pid}-{dead_start}-{int(namespace) + 1}"

        def store(tag: str, suffix: str = "abc_1234") -> Path:
            path = tmp_path / f"{STORE_PREFIX}{tag}-{suffix}"
            path.mkdir(mode=0o700)
            (path / "store").write_bytes(b"x")
            return path

        def key(tag: str) -> Path:
            path = tmp_path / f"{KEY_PREFIX}{tag}-k3y_5678"
            path.write_text("00" * 32)
            return path

        gone = [store(exited_tag), key(exited_tag), store(zombie_tag), key(reused)]
        target = tmp_path / "elsewhere"
        target.mkdir()
        link = tmp_path / f"{STORE_PREFIX}{exited_tag}-link0000"
        link.symlink_to(target)
        wrong_kind = tmp_path / f"{STORE_PREFIX}{exited_tag}-file0000"
        wrong_kind.write_text("")
        kept = [
            store(live_tag),
            key(live_tag),
            store(elsewhere),
            tmp_path / "afdserve-store-q1w2e3r4",
            link,
            wrong_kind,
        ]
        kept[3].mkdir()
        removed = remove_stale(str(tmp_path))
        assert sorted(removed) == sorted(str(p) for p in gone)
        assert not any(p.exists() for p in gone)
        assert all(p.exists() or p.is_symlink() for p in kept)
        assert target.is_dir()
    finally:
        _end(live)
        _end(zombie)


# A frontend that spawns its world (an LLM), or one that waits for ranks started elsewhere: the
# RankWorld alone (what writes the key file), which spares the test an LLM's imports.
SPAWNER_CODE = """
import sys
from afdserve import LLM
llm = LLM(sys.argv[1], topology="1A1F", dtype="float32")
print("STORE", llm.engine.core_client.world.store_dir, flush=True)
sys.stdin.read()
"""
WAITER_CODE = """
import logging, sys
from afdserve.afd.ranks.messages import WorkerSpec
from afdserve.afd.ranks.world import RankWorld
from afdserve.config import AFDConfig, EngineConfig, GraphConfig
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
spec = WorkerSpec(EngineConfig(model=sys.argv[1]), AFDConfig(topology="1A1F"), GraphConfig())
RankWorld(spec, spawn=False)
"""


def _frontend(code: str, model: Path, tmp: str | None = None) -> subprocess.Popen:
    """`tmp`: the temporary directory its files go to (TMPDIR)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if tmp is not None:
        env["TMPDIR"] = tmp
    env.pop("AFDSERVE_AUTHKEY", None)
    env.pop("AFDSERVE_AUTHKEY_FILE", None)
    return subprocess.Popen(
        [sys.executable, "-c", code, str(model)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
        # SIGINT as a terminal gives it: a run started in the background of a script ignores
        # SIGINT, and Python then keeps ignoring it in every child (no KeyboardInterrupt).
        preexec_fn=_default_sigint,
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _line(proc: subprocess.Popen, marker: str, within: float = 120) -> str:
    """The rest of the first line of `proc`'s output that holds `marker`."""
    assert proc.stdout is not None
    deadline, seen = time.monotonic() + within, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if marker in line:
            return line.split(marker, 1)[1].strip()
    raise AssertionError(f"no {marker!r} from the frontend:\n{''.join(seen[-30:])}")


def _children(pid: int) -> list[int]:
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


def _wait_gone(pids: list[int], within: float) -> list[int]:
    """The pids still running after `within` s (SIGKILLed then, so that none is left)."""
    deadline = time.monotonic() + within
    left = pids
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [pid for pid in left if Path(f"/proc/{pid}").exists()]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def test_a_killed_frontends_files_go_at_the_next_start_and_a_live_ones_stay(
    afd_models, monkeypatch
):
    """Three real frontends: one that spawned a world (a store directory) and one waiting for
    ranks started elsewhere with no key (a key file) are SIGKILLed; a third like the second
    stays alive. The next frontend to start removes the two killed ones' files, not the live
    one's; SIGINT then stops the live one, which removes its own."""
    from afdserve.afd.ranks.messages import WorkerSpec
    from afdserve.afd.ranks.world import RankWorld, WorkerError
    from afdserve.config import AFDConfig, EngineConfig, GraphConfig

    model = afd_models["qwen3_moe"]
    # A temporary directory of their own: any frontend started on this machine meanwhile (a
    # test beside this one) would otherwise remove the killed ones' files first.
    tmp = tempfile.mkdtemp(prefix="afd-")
    monkeypatch.setattr(tempfile, "tempdir", tmp)
    spawner = _frontend(SPAWNER_CODE, model, tmp)
    waiter = _frontend(WAITER_CODE, model, tmp)
    live = _frontend(WAITER_CODE, model, tmp)
    procs = [spawner, waiter, live]
    try:
        waiter_key = _line(waiter, "AFDSERVE_AUTHKEY_FILE=")
        live_key = _line(live, "AFDSERVE_AUTHKEY_FILE=")
        store = _line(spawner, "STORE ")
        ranks = _children(spawner.pid)
        assert len(ranks) == 2 and os.path.isdir(store)
        for proc in (spawner, waiter):
            proc.kill()
            proc.wait(timeout=10)
        # The killed frontend's ranks see their channel close and exit.
        assert _wait_gone(ranks, within=30) == []
        assert os.path.isdir(store) and os.path.exists(waiter_key)  # SIGKILL cleans nothing

        monkeypatch.delenv("AFDSERVE_AUTHKEY", raising=False)
        monkeypatch.delenv("AFDSERVE_AUTHKEY_FILE", raising=False)
        spec = WorkerSpec(EngineConfig(model=str(model)), AFDConfig(topology="1A1F"), GraphConfig())
        with pytest.raises(WorkerError, match="0 of 2 ranks connected"):
            RankWorld(spec, spawn=False, startup_timeout_s=0.5)  # the next frontend to start
        assert not os.path.exists(store) and not os.path.exists(waiter_key)
        assert os.path.exists(live_key)

        live.send_signal(signal.SIGINT)  # KeyboardInterrupt while it waits for its ranks
        assert live.wait(timeout=30) != 0
        assert not os.path.exists(live_key)
    finally:
        for proc in procs:
            _end(proc)
        frontend_files.remove_stale()
        shutil.rmtree(tmp, ignore_errors=True)


SERVER_CODE = """
import sys
from afdserve.llm import LLM
from afdserve.server.serve import ServeOptions, run_server

model, port, address = sys.argv[1], int(sys.argv[2]), sys.argv[3]
options = ServeOptions(host="127.0.0.1", port=port, uvicorn_log_level="warning")
llm = lambda: LLM(model, topology="2A1F", dtype="float32", frontend_address=address)
sys.exit(run_server(llm, options))
"""


@pytest.mark.slow
def test_a_server_drained_by_sigterm_leaves_no_key_file(afd_models, tmp_path):
    """`afdserve serve --frontend-address` with no key: ranks started elsewhere join with the
    key file the log names; SIGTERM drains the server, which exits 0 and leaves no key file."""
    import httpx

    from afdserve.frontend.process import free_port

    model, port, frontend, master = afd_models["qwen3_moe"], free_port(), free_port(), free_port()
    log_path = tmp_path / "server.log"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("AFDSERVE_AUTHKEY", None)
    env.pop("AFDSERVE_AUTHKEY_FILE", None)
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-c", SERVER_CODE, str(model), str(port), f"127.0.0.1:{frontend}"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    ranks: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + 120
        while "AFDSERVE_AUTHKEY_FILE=" not in log_path.read_text():
            assert server.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        key_file = log_path.read_text().split("AFDSERVE_AUTHKEY_FILE=")[1].split()[0]
        for rank in range(3):
            rank_env = dict(
                env,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(master),
                WORLD_SIZE="3",
                RANK=str(rank),
                AFDSERVE_FRONTEND=f"127.0.0.1:{frontend}",
                AFDSERVE_AUTHKEY_FILE=key_file,
            )
            ranks.append(
                subprocess.Popen([sys.executable, "-m", "afdserve.afd.ranks.worker"], env=rank_env)
            )
        while True:
            assert server.poll() is None and time.monotonic() < deadline, log_path.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        assert os.path.exists(key_file)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0, log_path.read_text()
        assert "drained" in log_path.read_text()
        assert not os.path.exists(key_file)
        for rank in ranks:
            assert rank.wait(timeout=30) == 0
    finally:
        for proc in [server, *ranks]:
            _end(proc)


def test_restart_with_ranks_elsewhere_needs_a_given_key(monkeypatch, capsys) -> None:
    """A generated key is written for one world; ranks elsewhere restarted by their torchrun
    would read a file that is gone. serve refuses the combination by name, before any port."""
    from afdserve.cli import main

    monkeypatch.delenv("AFDSERVE_AUTHKEY", raising=False)
    monkeypatch.delenv("AFDSERVE_AUTHKEY_FILE", raising=False)
    argv = ["serve", "--device", "cpu", "--frontend-address", "127.0.0.1:0"]
    assert main([*argv, "--on-engine-failure", "restart"]) == 2
    err = capsys.readouterr().err
    assert "--on-engine-failure restart with --frontend-address needs the ranks' key" in err
    assert "AFDSERVE_AUTHKEY" in err
