"""The frontend <-> rank channel: TCP connections that authenticate both ways with HMAC-SHA256 over
fresh random challenges, then carry length-prefixed frames of the message codec (codec.py: JSON
checked against the message types, never pickle). The key: `AFDSERVE_AUTHKEY` (hex) or
`AFDSERVE_AUTHKEY_FILE` (a file holding the hex key); it is never logged.

Why not `multiprocessing.connection.Listener(authkey=...)`: its handshake runs inside `accept()`,
so one peer that connects and stays silent blocks every rank behind it, a wrong key kills the
accepting thread with an exception other than OSError, and on Python 3.11 the MAC is HMAC-MD5.
Here one thread runs every pending handshake (`RankListener`: non-blocking sockets under a
selector), each with a deadline that also covers its first message (a `Hello`); a peer with a
wrong key, a silent one, or one whose first frame is not a well-formed `Hello` is dropped and
logged (LOGGED_WARNINGS lines a LOG_WINDOW_S at most), and the others go on: a flood of silent
connections costs file descriptors, never threads. After that, a `Channel` reads whatever has
arrived without waiting for the rest of a frame, so a peer that sends half a frame stalls
nobody. The channel is not encrypted: across hosts, run it on a private network.
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
import selectors
import socket
import struct
import threading
import time
from collections.abc import Iterable, Mapping

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
# Connections in their handshake at once; past this, the oldest is dropped (a rank's handshake
# takes milliseconds: the oldest is a silent peer). Bounds the descriptors a flood can hold.
MAX_PENDING_HANDSHAKES = 1024
ACCEPTS_PER_WAKE = 64  # then the pending handshakes get their turn
ACCEPT_PAUSE_S = 0.1  # after accept fails (out of descriptors): the listener waits, not spins
LOGGED_WARNINGS, LOG_WINDOW_S = 10, 10.0  # rejected peers logged one by one; the rest counted


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
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # Each message is one write and the next waits for nothing: without this, Nagle's
            # algorithm holds a rank's next Outputs until the frontend acknowledges the last,
            # and a frontend that has just sent a request delays its acknowledgements (up to
            # 40 ms on Linux), so every request's second token (or first, on a busy rank) and
            # every other stream's next token waited that long.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.peer = sock, peer
        self._buffer = bytearray()
        self._frames: collections.deque[bytes] = collections.deque()
        self._eof = False
        self._send_lock = threading.Lock()

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: object) -> None:
        self.send_many((message,))

    def send_many(self, messages: Iterable[object]) -> None:
        """The messages in one write, so that a peer woken by the first reads the rest with it."""
        data = b"".join(_HEADER.pack(len(frame)) + frame for frame in map(encode, messages))
        with self._send_lock:
            self.sock.sendall(data)

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


def _send_now(sock: socket.socket, data: bytes) -> None:
    """Send a few bytes on a non-blocking socket. The frontend sends 64 bytes in all before the
    Hello, far less than any TCP window: a partial send is a peer that is not a rank."""
    if sock.send(data) != len(data):
        raise ChannelError("the peer does not read")


class _Handshake:
    """One accepted connection on its way to its Hello: the challenge is sent, the peer's answer
    (its MAC and its own challenge) is read as it arrives; once the peer holds the key, its first
    frame arrives on the Channel it becomes."""

    ANSWER_BYTES = hashlib.sha256().digest_size + CHALLENGE_BYTES

    def __init__(self, sock: socket.socket, peer: str, key: bytes, deadline: float) -> None:
        self.sock, self.fd, self.peer = sock, sock.fileno(), peer
        self.key, self.deadline = key, deadline
        self.challenge = os.urandom(CHALLENGE_BYTES)
        self.answer = bytearray()
        self.channel: Channel | None = None
        _send_now(sock, self.challenge)

    def advance(self) -> Hello | None:
        """Take what has arrived: the Hello once it is in, None while more is to come.
        ChannelError, OSError or EOFError: drop the peer."""
        if self.channel is None:
            try:
                chunk = self.sock.recv(self.ANSWER_BYTES - len(self.answer))
            except (BlockingIOError, InterruptedError):
                return None
            if not chunk:
                raise ChannelError("the peer closed the connection during the handshake")
            self.answer += chunk
            if len(self.answer) < self.ANSWER_BYTES:
                return None
            mac, theirs = self.answer[:-CHALLENGE_BYTES], self.answer[-CHALLENGE_BYTES:]
            if not hmac.compare_digest(bytes(mac), _mac(self.key, _RANK, self.challenge)):
                raise ChannelError("the peer does not hold the key")
            _send_now(self.sock, _mac(self.key, _FRONTEND, bytes(theirs)))
            self.channel = Channel(self.sock, f"rank connection from {self.peer}")
        if not self.channel.poll():
            return None
        hello = self.channel.recv()
        if not isinstance(hello, Hello):
            raise ChannelError(f"opened with {type(hello).__name__}, not Hello")
        return hello


class _ThrottledLog:
    """The listener's warnings, at most `burst` lines per `window_s`; the rest are counted and
    said in one line when the window ends, so that a flood of bad peers cannot fill the log."""

    def __init__(self, burst: int, window_s: float) -> None:
        self.burst, self.window_s = burst, window_s
        self.window_end, self.logged, self.suppressed = 0.0, 0, 0

    def warning(self, now: float, message: str, *args: object) -> None:
        self.flush(now)
        if now >= self.window_end:
            self.window_end, self.logged = now + self.window_s, 0
        if self.logged < self.burst:
            self.logged += 1
            log.warning(message, *args)
        else:
            self.suppressed += 1

    def flush(self, now: float) -> None:
        if self.suppressed and now >= self.window_end:
            log.warning(
                "%d more rank connection warning(s) in the last %g s, not logged one by one "
                "(at most %d a window)",
                self.suppressed,
                self.window_s,
                self.burst,
            )
            self.suppressed = 0

    @property
    def due(self) -> float | None:
        """When `flush` has a line to write; None when it has none."""
        return self.window_end if self.suppressed else None


class RankListener:
    """Accepts rank connections in the background; `get(timeout)` hands out authenticated ones
    with the `Hello` each opened with. Binds to the address given: loopback unless the frontend
    serves ranks on other hosts.

    One thread runs every handshake (a selector over the pending connections, each a small state
    machine with a deadline), so a flood of connections that say nothing costs file descriptors,
    at most MAX_PENDING_HANDSHAKES of them, and no threads; past that many, the oldest pending
    one is dropped: a rank's handshake takes milliseconds, so the oldest is a silent peer."""

    def __init__(self, address: tuple[str, int], key: bytes) -> None:
        self.key = key
        self.timeout_s = HANDSHAKE_TIMEOUT_S
        self.sock = socket.create_server(address)
        self.sock.setblocking(False)
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self.ready: queue.Queue[tuple[Hello, Channel]] = queue.Queue()
        self.rejected = 0
        self._closed = False
        self._lock = threading.Lock()  # the loop's work on one batch of events, or close()
        self._selector = selectors.DefaultSelector()
        self._wake, self._waker = socket.socketpair()
        self._selector.register(self.sock, selectors.EVENT_READ)
        self._selector.register(self._wake, selectors.EVENT_READ)
        self._pending: dict[int, _Handshake] = {}  # by file descriptor, oldest first
        self._accept_paused_until: float | None = None
        self._log = _ThrottledLog(LOGGED_WARNINGS, LOG_WINDOW_S)
        threading.Thread(target=self._serve, name="afdserve-rank-listener", daemon=True).start()

    @property
    def pending(self) -> int:
        """Connections accepted whose Hello has not arrived yet."""
        return len(self._pending)

    def _serve(self) -> None:
        try:
            while True:
                events = self._selector.select(self._next_wake())
                with self._lock:
                    if self._closed:
                        return
                    now = time.monotonic()
                    for key, _ in events:
                        if key.fileobj is self.sock:
                            self._accept(now)
                        elif key.data is not None:
                            self._advance(key.data, now)
                    self._expire(now)
                    if self._accept_paused_until is not None and now >= self._accept_paused_until:
                        self._accept_paused_until = None
                        self._selector.register(self.sock, selectors.EVENT_READ)
                    self._log.flush(now)
        finally:
            for handshake in self._pending.values():
                handshake.sock.close()
            self._pending.clear()
            self._selector.close()
            self._wake.close()

    def _next_wake(self) -> float | None:
        times = [t for t in (self._accept_paused_until, self._log.due) if t is not None]
        if self._pending:
            times.append(next(iter(self._pending.values())).deadline)
        return max(0.0, min(times) - time.monotonic()) if times else None

    def _accept(self, now: float) -> None:
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                sock, peer = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                # Out of file descriptors (peers holding connections open) or an aborted
                # connection: the listener must outlive it, or the ranks still to come hang.
                # The socket stays readable, so accepting pauses a moment instead of spinning.
                self._log.warning(now, "accepting a rank connection failed: %s; still listening", e)
                self._selector.unregister(self.sock)
                self._accept_paused_until = now + ACCEPT_PAUSE_S
                return
            if len(self._pending) >= MAX_PENDING_HANDSHAKES:
                oldest = next(iter(self._pending.values()))
                self._reject(
                    oldest,
                    now,
                    f"dropped unanswered: {MAX_PENDING_HANDSHAKES} handshakes were pending",
                )
            try:
                sock.setblocking(False)
                handshake = _Handshake(sock, peer[0], self.key, now + self.timeout_s)
            except (OSError, ChannelError) as e:
                self.rejected += 1
                self._log.warning(now, "rejected a rank connection from %s: %s", peer[0], e)
                sock.close()
                continue
            self._pending[handshake.fd] = handshake
            self._selector.register(sock, selectors.EVENT_READ, handshake)

    def _advance(self, handshake: _Handshake, now: float) -> None:
        if self._pending.get(handshake.fd) is not handshake:
            return  # dropped earlier in this batch of events
        try:
            hello = handshake.advance()
        except Exception as e:  # OSError, EOFError, ChannelError: whatever the peer did, drop it
            self._reject(handshake, now, e)
            return
        if hello is not None:
            assert handshake.channel is not None
            self._forget(handshake)
            self.ready.put((hello, handshake.channel))

    def _expire(self, now: float) -> None:
        # Every deadline is accept time + timeout_s: the oldest pending connection expires first.
        while self._pending:
            oldest = next(iter(self._pending.values()))
            if oldest.deadline > now:
                return
            self._reject(oldest, now, f"no Hello within {self.timeout_s:g} s")

    def _forget(self, handshake: _Handshake) -> None:
        del self._pending[handshake.fd]
        self._selector.unregister(handshake.sock)

    def _reject(self, handshake: _Handshake, now: float, why: object) -> None:
        self._forget(handshake)
        handshake.sock.close()
        self.rejected += 1
        self._log.warning(now, "rejected a rank connection from %s: %s", handshake.peer, why)

    def get(self, timeout: float) -> tuple[Hello, Channel] | None:
        try:
            return self.ready.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stop listening (a complete world takes no more connections); what is queued closes,
        and so does every connection still in its handshake."""
        with self._lock:
            if not self._closed:
                self._closed = True
                # Closed, it leaves the selector (epoll drops it); the loop, woken by the end of
                # the waker's stream, touches nothing more but closes the rest.
                self.sock.close()
                self._waker.close()
        while True:
            try:
                self.ready.get_nowait()[1].close()
            except queue.Empty:
                return


class Waker:
    """A socket pair: any thread's `wake()` ends a `multiprocessing.connection.wait` that
    includes this (its `fileno()`), so a thread waiting on its ranks' outputs also notices work
    that another thread queued for it. `drain()` after the wait; wakes never block (a full pair
    means a wake is pending already) and are ignored once closed."""

    def __init__(self) -> None:
        self._read, self._write = socket.socketpair()
        self._read.setblocking(False)
        self._write.setblocking(False)

    def fileno(self) -> int:
        return self._read.fileno()

    def wake(self) -> None:
        try:
            self._write.send(b"\0")
        except OSError:  # BlockingIOError: a wake is pending; others: closed
            pass

    def drain(self) -> None:
        try:
            while self._read.recv(4096):
                pass
        except OSError:  # BlockingIOError: drained
            pass

    def close(self) -> None:
        self._read.close()
        self._write.close()
