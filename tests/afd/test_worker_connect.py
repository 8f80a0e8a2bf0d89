"""A rank's connection to the frontend (worker.connect_to_frontend) over real sockets: transient
network refusals (a reset handshake, then no listener at all) are retried until the frontend
listens; a frontend with another key is refused at once, not retried."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from afdserve.afd.ranks.channel import ChannelError, RankListener
from afdserve.afd.ranks.messages import Hello
from afdserve.afd.ranks.worker import connect_to_frontend

KEY = os.urandom(32)


def test_a_reset_then_refused_connection_is_retried_until_the_frontend_listens():
    raw = socket.create_server(("127.0.0.1", 0))
    port = raw.getsockname()[1]
    box: dict = {}

    def reset_then_listen() -> None:
        sock, _ = raw.accept()
        # Linger 0: closing sends a reset, which the rank reads as ConnectionResetError.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
        box["reset"] = True
        raw.close()  # connections are refused until the listener binds the port
        time.sleep(1.0)
        box["listener"] = RankListener(("127.0.0.1", port), KEY)

    frontend = threading.Thread(target=reset_then_listen)
    frontend.start()
    try:
        conn = connect_to_frontend(("127.0.0.1", port), KEY, time.monotonic() + 20)
        frontend.join(5)
        assert box.get("reset")
        conn.send(Hello(1))
        hello, _ = box["listener"].get(timeout=5)
        assert hello == Hello(1)
        conn.close()
    finally:
        frontend.join(5)
        if "listener" in box:
            box["listener"].close()


def test_a_frontend_with_another_key_is_not_retried():
    impostor = RankListener(("127.0.0.1", 0), os.urandom(32))
    try:
        start = time.monotonic()
        with pytest.raises(ChannelError):
            connect_to_frontend(impostor.address, KEY, time.monotonic() + 60)
        assert time.monotonic() - start < 10, "a key mismatch must fail at once"
    finally:
        impostor.close()


def test_a_rank_whose_frontend_died_before_it_connected_stops(tmp_path):
    """A spawned rank (AFDSERVE_STORE_PATH set) whose frontend is gone before it connects stops
    at its first refused retry, not after CONNECT_TIMEOUT_S with its memory held: a real worker
    process, orphaned by the process that spawned it exiting at once."""
    import subprocess
    import sys

    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there
    log = tmp_path / "rank.log"
    env = {
        **os.environ,
        "AFDSERVE_FRONTEND": f"127.0.0.1:{port}",
        "AFDSERVE_AUTHKEY": KEY.hex(),
        "AFDSERVE_STORE_PATH": str(tmp_path / "store"),
        "RANK": "0",
    }
    spawn = (  # as world.spawn_rank sets it: the spawner's pid
        "import os, subprocess, sys; os.environ['AFDSERVE_FRONTEND_PID'] = str(os.getpid()); "
        f"p = subprocess.Popen([sys.executable, '-m', 'afdserve.afd.ranks.worker'], "
        f"stdout=subprocess.DEVNULL, stderr=open({str(log)!r}, 'w')); print(p.pid)"
    )
    out = subprocess.run([sys.executable, "-c", spawn], env=env, capture_output=True, text=True)
    pid = int(out.stdout)
    deadline = time.monotonic() + 90  # the import of torch first; CONNECT_TIMEOUT_S is 300
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        os.kill(pid, 9)
        pytest.fail(f"the orphaned rank {pid} still retries: {log.read_text()[-500:]}")
    assert "frontend that spawned this rank" in log.read_text()
