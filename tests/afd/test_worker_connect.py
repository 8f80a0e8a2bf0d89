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
