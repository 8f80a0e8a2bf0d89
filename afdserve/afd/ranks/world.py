"""The rank processes of one world, seen from the frontend: start them (or wait for ranks started
elsewhere), authenticate their connections, hand out the WorkerSpec, wait until every rank is
ready, pump their messages, notice a rank that died or stopped making progress, and stop them all,
leaving no process behind.

Network exposure of a built-in (one-host) world: the rank channel listens on loopback until every
rank has connected, then closes; the rendezvous store is a torch FileStore in a directory only
this user can open (mode 0700), so no socket serves it and no other user can read or write its
keys (a TCPStore, even on loopback, answers any local process: torch gives it no
authentication); gloo and NCCL bootstrap over the loopback interface. Ranks started elsewhere
(torchrun) rendezvous through env:// as usual, whose TCPStore, like gloo and NCCL themselves,
has no authentication: such a world belongs on a private network (docs/design.md).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import wait

from afdserve.afd.ranks.channel import Channel, ChannelError, RankListener, read_key
from afdserve.afd.ranks.messages import Outputs, RankFailed, RankReady, Shutdown, WorkerSpec

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
JOIN_TIMEOUT_S = 20.0
KILL_WAIT_S = 5.0


class WorkerError(RuntimeError):
    """A rank failed, hung, or the world could not start; carries what is known of why."""


class Lost:
    """The connection to a rank broke (frontend-side only, never sent)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankWorld:
    def __init__(
        self,
        spec: WorkerSpec,
        spawn: bool = True,
        frontend_address: tuple[str, int] = ("127.0.0.1", 0),
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> None:
        self.spec, self.world = spec, spec.topology.world_size
        self.procs: list[subprocess.Popen] = []
        self.conns: dict[int, Channel] = {}
        self.ready: dict[int, RankReady] = {}
        self.last_heard: dict[int, float] = {}
        self.closed = False
        self.store_dir: str | None = None
        key = read_key()
        self.authkey = key if key is not None else os.urandom(32)
        self.listener = RankListener(frontend_address, self.authkey)
        self.address = self.listener.address
        try:
            if spawn:
                self._spawn()
            else:
                log.info(
                    "waiting for %d ranks at %s:%d; %s",
                    self.world,
                    *self.address,
                    self._where_the_key_is(key is not None),
                )
            deadline = time.monotonic() + startup_timeout_s
            self._accept(deadline)
            self.listener.close()  # every rank is in: nobody else may connect
            self._wait_ready(deadline)
        except BaseException:
            self.shutdown()
            raise

    def _where_the_key_is(self, given: bool) -> str:
        """Ranks started elsewhere need the key: say where it is, never what it is."""
        if given:
            source = (
                "AFDSERVE_AUTHKEY"
                if os.environ.get("AFDSERVE_AUTHKEY")
                else (f"AFDSERVE_AUTHKEY_FILE={os.environ['AFDSERVE_AUTHKEY_FILE']}")
            )
            return f"they authenticate with the key from {source}"
        fd, path = tempfile.mkstemp(prefix="afdserve-authkey-")  # mode 0600, this user only
        with os.fdopen(fd, "w") as f:
            f.write(self.authkey.hex() + "\n")
        return (
            f"a fresh key was written to {path} (mode 0600): start the ranks with "
            f"AFDSERVE_AUTHKEY_FILE={path}"
        )

    def _spawn(self) -> None:
        # The rendezvous store: a FileStore in a directory of this user's alone (0700).
        self.store_dir = tempfile.mkdtemp(prefix="afdserve-store-")
        for rank in range(self.world):
            env = dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                WORLD_SIZE=str(self.world),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                AFDSERVE_FRONTEND=f"{self.address[0]}:{self.address[1]}",
                AFDSERVE_AUTHKEY=self.authkey.hex(),
                AFDSERVE_STORE_PATH=os.path.join(self.store_dir, "store"),
            )
            env.pop("AFDSERVE_AUTHKEY_FILE", None)
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "afdserve.afd.ranks.worker"],
                    env=env,
                    stdin=subprocess.DEVNULL,
                )
            )

    def _accept(self, deadline: float) -> None:
        while len(self.conns) < self.world:
            got = self.listener.get(timeout=0.2)
            if got is not None:
                hello, conn = got
                if hello.rank in self.conns or not 0 <= hello.rank < self.world:
                    log.warning(
                        "dropped a %s: it said it is rank %d of %d, %s",
                        conn.peer,
                        hello.rank,
                        self.world,
                        "which has connected already"
                        if hello.rank in self.conns
                        else "which does not exist",
                    )
                    conn.close()
                    continue
                self.conns[hello.rank] = conn
                conn.send(self.spec)
            self.check_alive("during start-up")
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"only {len(self.conns)} of {self.world} ranks connected "
                    f"before the start-up timeout"
                )

    def _wait_ready(self, deadline: float) -> None:
        while len(self.ready) < self.world:
            for msg in self.messages(0.2):
                if isinstance(msg, RankFailed):
                    raise WorkerError(f"rank {msg.rank} failed during start-up:\n{msg.traceback}")
                if isinstance(msg, Lost):
                    self.check_alive("during start-up")
                    raise WorkerError(f"rank {msg.rank} disconnected during start-up")
                if isinstance(msg, RankReady):
                    self.ready[msg.rank] = msg
                    log.info("%s", msg.memory.line())
            self.check_alive("during start-up")
            if time.monotonic() > deadline:
                raise WorkerError("ranks not ready before the start-up timeout")
        now = time.monotonic()
        self.last_heard = {rank: now for rank in self.ready if self.ready[rank].limits}

    def messages(self, timeout: float) -> list:
        """Every message waiting from any rank (a broken connection becomes `Lost`)."""
        msgs: list = []
        for conn in wait(list(self.conns.values()), timeout=timeout):
            rank = next(r for r, c in self.conns.items() if c is conn)
            try:
                while conn.poll():
                    msg = conn.recv()
                    msgs.append(msg)
                    if isinstance(msg, Outputs):
                        self.last_heard[rank] = time.monotonic()
            except (EOFError, OSError) as e:  # ChannelError (a malformed frame) included
                if isinstance(e, ChannelError):
                    log.error("dropped rank %d's connection: %s", rank, e)
                self.conns.pop(rank).close()
                msgs.append(Lost(rank))
        return msgs

    def check_alive(self, when: str) -> None:
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                raise WorkerError(
                    f"rank {rank} exited {when} with code {code} (its error is printed above)"
                )

    def check_progress(self, timeout_s: float) -> None:
        """Attention ranks report after every step and at least twice a second when idle; one
        that stays silent is stuck (or a rank it waits on is): the world has stopped."""
        now = time.monotonic()
        for rank, heard in self.last_heard.items():
            if now - heard > timeout_s:
                raise WorkerError(
                    f"attention rank {rank} made no progress for {now - heard:.1f} s "
                    f"(heartbeat_timeout_s={timeout_s}): a rank is hung"
                )

    def send(self, rank: int, message) -> None:
        self.conns[rank].send(message)

    def shutdown(self) -> None:
        """Ask every rank to stop; kill what is still running after JOIN_TIMEOUT_S (a stopped or
        hung process included)."""
        if self.closed:
            return
        self.closed = True
        for conn in self.conns.values():
            try:
                conn.send(Shutdown())
            except OSError:
                pass
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        for conn in self.conns.values():
            conn.close()
        self.listener.close()
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL every rank process still alive (SIGTERM would wait on a stopped one)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                log.error("rank process %d did not exit after SIGKILL", proc.pid)
