"""The frontend <-> rank channel: both sides prove the key (HMAC-SHA256) before anything is
unpickled; a wrong key or a silent peer is dropped without holding up the others; a built-in
world listens on loopback only."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from afdserve import LLM
from afdserve.afd.ranks.channel import HANDSHAKE_TIMEOUT_S, ChannelError, RankListener, connect

KEY = os.urandom(32)


@pytest.fixture
def listener():
    server = RankListener(("127.0.0.1", 0), KEY)
    yield server
    server.close()


def test_both_sides_prove_the_key(listener):
    got = {}
    worker = threading.Thread(target=lambda: got.setdefault("conn", connect(listener.address, KEY)))
    worker.start()
    conn = listener.get(timeout=5)
    worker.join(5)
    got["conn"].send({"hello": 1})
    assert conn.recv() == {"hello": 1}
    with pytest.raises(ChannelError):
        connect(listener.address, os.urandom(32))  # the frontend drops it: the peer sees it
    deadline = time.monotonic() + 5
    while listener.rejected < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert listener.rejected == 1 and listener.get(timeout=0.2) is None


def test_a_frontend_without_the_key_is_refused():
    """Keys differ: the handshake fails on both sides, and the rank gets no connection."""
    impostor = RankListener(("127.0.0.1", 0), os.urandom(32))
    try:
        with pytest.raises(ChannelError):
            connect(impostor.address, KEY)
    finally:
        impostor.close()


def test_silent_peers_do_not_block_others(listener):
    silent = [socket.create_connection(listener.address) for _ in range(3)]
    try:
        start = time.monotonic()
        conn = connect(listener.address, KEY)
        assert listener.get(timeout=5) is not None
        assert time.monotonic() - start < 2.0  # not queued behind the silent ones
        conn.close()
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S + 5
        while listener.rejected < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert listener.rejected == 3  # each dropped after the handshake deadline
    finally:
        for s in silent:
            s.close()


def _listening_inodes() -> dict[str, str]:
    """inode -> local address of every listening TCP socket (IPv4 and IPv6)."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    out[fields[9]] = fields[1]
    return out


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _is_loopback(address: str) -> bool:
    host = address.split(":")[0]
    if len(host) == 8:  # IPv4, little-endian hex: 127.x.x.x ends in 7F
        return host.endswith("7F")
    return host in ("00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


def test_a_built_in_world_listens_on_loopback_only(afd_models):
    with LLM(str(afd_models["qwen3_moe"]), topology="2A1F", dtype="float32") as llm:
        listening = _listening_inodes()
        pids = [os.getpid()] + [p.pid for p in llm.engine.core_client.world.procs]
        mine = {inode: listening[inode] for pid in pids for inode in _socket_inodes(pid)
                if inode in listening}
    assert mine, "the world listens on no TCP socket at all"
    assert {a for a in mine.values() if not _is_loopback(a)} == set()
