"""The frontend <-> rank channel: TCP connections that authenticate both ways with HMAC-SHA256 over
fresh random challenges before any message is unpickled.

Why not `multiprocessing.connection.Listener(authkey=...)`: its handshake runs inside `accept()`,
so one peer that connects and stays silent blocks every rank behind it, a wrong key kills the
accepting thread with an exception other than OSError, and on Python 3.11 the MAC is HMAC-MD5.
Here each connection gets its own handshake thread with a deadline; a bad or silent peer is
dropped and logged, and the others go on. After the handshake, messages travel as pickles over
`multiprocessing.connection.Connection` (the peer has proved it holds the key). The channel is
not encrypted: across hosts, run it on a private network.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import socket
import threading
from multiprocessing.connection import Connection

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
CHALLENGE_BYTES = 32
_RANK, _FRONTEND = b"afdserve-rank", b"afdserve-frontend"


class ChannelError(ConnectionError):
    """A peer failed the handshake (wrong key, silent, or not an afdserve peer)."""


def _mac(key: bytes, role: bytes, challenge: bytes) -> bytes:
    return hmac.new(key, role + challenge, hashlib.sha256).digest()


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ChannelError("the peer closed the connection during the handshake")
        data += chunk
    return data


def _serve_handshake(sock: socket.socket, key: bytes) -> Connection:
    challenge = os.urandom(CHALLENGE_BYTES)
    sock.sendall(challenge)
    answer = _read_exactly(sock, hashlib.sha256().digest_size)
    theirs = _read_exactly(sock, CHALLENGE_BYTES)
    if not hmac.compare_digest(answer, _mac(key, _RANK, challenge)):
        raise ChannelError("the peer does not hold the key")
    sock.sendall(_mac(key, _FRONTEND, theirs))
    sock.settimeout(None)
    return Connection(sock.detach())


def connect(address: tuple[str, int], key: bytes,
            timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Connection:
    """A rank's side: connect, prove the key, and check that the frontend holds it too."""
    sock = socket.create_connection(address, timeout=timeout_s)
    try:
        challenge = _read_exactly(sock, CHALLENGE_BYTES)
        mine = os.urandom(CHALLENGE_BYTES)
        sock.sendall(_mac(key, _RANK, challenge) + mine)
        reply = _read_exactly(sock, hashlib.sha256().digest_size)
        if not hmac.compare_digest(reply, _mac(key, _FRONTEND, mine)):
            raise ChannelError(f"the frontend at {address[0]}:{address[1]} does not hold the key")
        sock.settimeout(None)
        return Connection(sock.detach())
    except BaseException:
        sock.close()
        raise


class RankListener:
    """Accepts rank connections in the background; `get(timeout)` hands out authenticated ones.
    Binds to the address given: loopback unless the frontend serves ranks on other hosts."""

    def __init__(self, address: tuple[str, int], key: bytes) -> None:
        self.key = key
        self.sock = socket.create_server(address)
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self.ready: queue.Queue[Connection] = queue.Queue()
        self.rejected = 0
        self._closed = False
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, peer = self.sock.accept()
            except OSError:
                return  # closed
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            threading.Thread(target=self._handshake, args=(sock, peer), daemon=True).start()

    def _handshake(self, sock: socket.socket, peer) -> None:
        try:
            self.ready.put(_serve_handshake(sock, self.key))
        except (OSError, ChannelError) as e:
            self.rejected += 1
            log.warning("rejected a rank connection from %s: %s", peer[0], e)
            sock.close()

    def get(self, timeout: float) -> Connection | None:
        try:
            return self.ready.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self._closed = True
        self.sock.close()
