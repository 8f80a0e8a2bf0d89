"""The frontend <-> rank channel: TCP connections that authenticate both ways with HMAC-SHA256 over
fresh random challenges, then carry length-prefixed frames of the message codec (codec.py: JSON
checked against the message types, never pickle). The key: `AFDSERVE_AUTHKEY` (hex) or
`AFDSERVE_AUTHKEY_FILE` (a file holding the hex key); it is never logged.

Why not `multiprocessing.connection.Listener(authkey=...)`: its handshake runs inside `accept()`,
so one peer that connects and stays silent blocks every rank behind it, a wrong key kills the
accepting thread with an exception other than OSError, and on Python 3.11 the MAC is HMAC-MD5.
Here each connection gets its own handshake thread with a deadline that also covers its first
message (a `Hello`); a peer with a wrong key, a silent one, or one whose first frame is not a
well-formed `Hello` is dropped and logged, and the others go on. After that, a `Channel` reads
whatever has arrived without waiting for the rest of a frame, so a peer that sends half a frame
stalls nobody. The channel is not encrypted: across hosts, run it on a private network.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import hmac
import logging
import os
import queue
import select
import socket
import struct
import threading
import time
from collections.abc import Mapping

from afdserve.afd.ranks.codec import DecodeError, decode, encode
from afdserve.afd.ranks.messages import Hello

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
CHALLENGE_BYTES = 32
# The largest frame either side accepts. The largest real one is a step's Outputs with logprobs
# (about 20 entries per token); a length beyond this is a peer that is not an afdserve rank.
MAX_FRAME_BYTES = 64 << 20
_HEADER = struct.Struct("!I")
_RANK, _FRONTEND = b"afdserve-rank", b"afdserve-frontend"
_READ_CHUNK = 1 << 20


class ChannelError(ConnectionError):
    """A peer failed the handshake (wrong key, silent, or not an afdserve peer) or sent a frame
    that is not a message."""


def read_key(env: Mapping[str, str] = os.environ) -> bytes | None:
    """The shared key from AFDSERVE_AUTHKEY (hex) or AFDSERVE_AUTHKEY_FILE, or None when neither
    is set. Error messages name the variable, never the key."""
    text, source = env.get("AFDSERVE_AUTHKEY"), "AFDSERVE_AUTHKEY"
    if not text and env.get("AFDSERVE_AUTHKEY_FILE"):
        source = f"AFDSERVE_AUTHKEY_FILE={env['AFDSERVE_AUTHKEY_FILE']}"
        try:
            with open(env["AFDSERVE_AUTHKEY_FILE"]) as f:
                text = f.read().strip()
        except OSError as e:
            raise ValueError(f"{source}: cannot be read ({e.strerror})") from None
    if not text:
        return None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(
            f"{source}: must be a hex string (e.g. from os.urandom(32).hex())"
        ) from None
    if len(key) < 16:
        raise ValueError(f"{source}: must hold at least 16 bytes (32 hex digits), got {len(key)}")
    return key


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


class Channel:
    """One authenticated connection, whole messages each way. `poll()` reads what has arrived
    without blocking and reports whether a whole frame (or the end of the stream) is there;
    `recv()` hands out the next message. `fileno()` lets `multiprocessing.connection.wait` watch
    it: after a drain (`poll()` until False) no whole frame is left in the buffer, so readability
    of the socket is the only thing to wait for."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        sock.settimeout(None)
        self.sock, self.peer = sock, peer
        self._buffer = bytearray()
        self._frames: collections.deque[bytes] = collections.deque()
        self._eof = False
        self._send_lock = threading.Lock()

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: object) -> None:
        frame = encode(message)
        with self._send_lock:
            self.sock.sendall(_HEADER.pack(len(frame)) + frame)

    def poll(self, timeout: float = 0.0) -> bool:
        """True when a message (or the end of the stream) is ready; waits up to `timeout` s."""
        if self._frames or self._eof:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._read_available()
            if self._frames or self._eof:
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            select.select([self.sock], [], [], left)

    def recv(self, timeout: float | None = None) -> object:
        """The next message. EOFError: the peer closed; TimeoutError: none within `timeout` s;
        ChannelError: the peer sent something that is not a message (drop the connection)."""
        if not self.poll(timeout):
            raise TimeoutError(f"no message from {self.peer} within {timeout} s")
        if not self._frames:
            raise EOFError(f"{self.peer} closed the connection")
        try:
            return decode(self._frames.popleft())
        except DecodeError as e:
            raise ChannelError(f"{self.peer} sent a malformed message: {e}") from None

    def _read_available(self) -> None:
        while not self._eof:
            try:
                chunk = self.sock.recv(_READ_CHUNK, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                if e.errno in (errno.ECONNRESET, errno.EPIPE, errno.EBADF):
                    self._eof = True
                    break
                raise
            if not chunk:
                self._eof = True
                break
            self._buffer += chunk
            self._split_frames()

    def _split_frames(self) -> None:
        while len(self._buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buffer)
            if size > MAX_FRAME_BYTES:
                raise ChannelError(
                    f"{self.peer} announced a frame of {size} bytes (at most {MAX_FRAME_BYTES})"
                )
            if len(self._buffer) < _HEADER.size + size:
                return
            self._frames.append(bytes(self._buffer[_HEADER.size : _HEADER.size + size]))
            del self._buffer[: _HEADER.size + size]

    def close(self) -> None:
        self.sock.close()


def _serve_handshake(sock: socket.socket, key: bytes) -> None:
    challenge = os.urandom(CHALLENGE_BYTES)
    sock.sendall(challenge)
    answer = _read_exactly(sock, hashlib.sha256().digest_size)
    theirs = _read_exactly(sock, CHALLENGE_BYTES)
    if not hmac.compare_digest(answer, _mac(key, _RANK, challenge)):
        raise ChannelError("the peer does not hold the key")
    sock.sendall(_mac(key, _FRONTEND, theirs))


def connect(
    address: tuple[str, int], key: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S
) -> Channel:
    """A rank's side: connect, prove the key, and check that the frontend holds it too."""
    sock = socket.create_connection(address, timeout=timeout_s)
    try:
        challenge = _read_exactly(sock, CHALLENGE_BYTES)
        mine = os.urandom(CHALLENGE_BYTES)
        sock.sendall(_mac(key, _RANK, challenge) + mine)
        reply = _read_exactly(sock, hashlib.sha256().digest_size)
        if not hmac.compare_digest(reply, _mac(key, _FRONTEND, mine)):
            raise ChannelError(f"the frontend at {address[0]}:{address[1]} does not hold the key")
        return Channel(sock, f"frontend {address[0]}:{address[1]}")
    except BaseException:
        sock.close()
        raise


class RankListener:
    """Accepts rank connections in the background; `get(timeout)` hands out authenticated ones
    with the `Hello` each opened with. Binds to the address given: loopback unless the frontend
    serves ranks on other hosts."""

    def __init__(self, address: tuple[str, int], key: bytes) -> None:
        self.key = key
        self.sock = socket.create_server(address)
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self.ready: queue.Queue[tuple[Hello, Channel]] = queue.Queue()
        self.rejected = 0
        self._closed = False
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, peer = self.sock.accept()
            except OSError as e:
                if self._closed:
                    return
                # Out of file descriptors (peers holding connections open) or an aborted
                # connection: the listener must outlive it, or the ranks still to come hang.
                log.warning("accepting a rank connection failed: %s; still listening", e)
                time.sleep(0.1)
                continue
            threading.Thread(target=self._handshake, args=(sock, peer), daemon=True).start()

    def _handshake(self, sock: socket.socket, peer: tuple) -> None:
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            _serve_handshake(sock, self.key)
            channel = Channel(sock, f"rank connection from {peer[0]}")
            hello = channel.recv(timeout=max(0.0, deadline - time.monotonic()))
            if not isinstance(hello, Hello):
                raise ChannelError(f"opened with {type(hello).__name__}, not Hello")
            self.ready.put((hello, channel))
        except (OSError, EOFError, ChannelError) as e:  # TimeoutError is an OSError
            self.rejected += 1
            log.warning("rejected a rank connection from %s: %s", peer[0], e)
            sock.close()

    def get(self, timeout: float) -> tuple[Hello, Channel] | None:
        try:
            return self.ready.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stop listening (a complete world takes no more connections); what is queued closes."""
        self._closed = True
        self.sock.close()
        while True:
            try:
                self.ready.get_nowait()[1].close()
            except queue.Empty:
                return
