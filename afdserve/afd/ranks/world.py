"""The rank processes of one world, seen from the frontend: start them (or wait for ranks started
elsewhere), authenticate their connections, hand out the WorkerSpec, wait until every rank is
ready, pump their messages, notice a rank that died or stopped making progress, rebuild the world
around the ranks that survived one (`RankWorld.rebuild`: a new generation, only the failed ranks
replaced), and stop them all, leaving no process behind.

Network exposure of a built-in (one-host) world: the rank channel listens on loopback until every
rank has connected, then closes (a rebuild's replacement connects to a standby world's listener or
to one opened for it alone, on loopback, closed once it is in); the rendezvous store is a torch
FileStore in a directory only this user can open (mode 0700, a fresh file per generation;
removed at shutdown, or by the next frontend when this one was killed: frontend_files.py): no
socket serves it (a TCPStore, even on loopback, answers any local process); gloo and NCCL
bootstrap over loopback. Ranks started elsewhere (torchrun) rendezvous through env://, whose
TCPStore, like gloo and NCCL themselves, has no authentication: such a world belongs on a private
network (docs/design.md).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from multiprocessing.connection import wait
from pathlib import Path

from afdserve.afd.ranks.channel import Channel, ChannelError, RankListener, Waker, read_key
from afdserve.afd.ranks.frontend_files import make_store_dir, remove, write_key_file
from afdserve.afd.ranks.messages import (
    Nudge,
    Outputs,
    Parted,
    RankFailed,
    RankReady,
    Rejoin,
    Shutdown,
    WorkerSpec,
)

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
JOIN_TIMEOUT_S = 20.0
KILL_WAIT_S = 5.0
# How long the surviving ranks of a broken world have to say `Parted`: each notices the failure
# in its next gloo operation or control round (a dead peer's sockets close at once; a rank that
# leaves destroys its groups, which closes its own), so this is seconds on a loaded host. A
# survivor that stays silent is stuck: the world restarts whole.
PART_TIMEOUT_S = 15.0


class WorkerError(RuntimeError):
    """A rank failed, hung, or the world could not start; carries what is known of why."""


class Lost:
    """The connection to a rank broke (frontend-side only, never sent)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank


def process_stopped(pid: int) -> bool:
    """The process is stopped by a signal or traced (Linux: /proc/PID/stat's state T or t).
    False where /proc cannot tell (another OS, a process that is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_authkey() -> bytes:
    key = read_key()
    return key if key is not None else os.urandom(32)


class Standby:
    """The processes of a built-in world started before they are needed: each imports
    everything a rank needs (torch, the model code: most of a rank's start on a busy host),
    connects and waits for its WorkerSpec. A restarted world takes them (`STANDBY`), so that
    it starts with weight loading, not with Python's imports."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.authkey = world_authkey()
        self.listener = RankListener(("127.0.0.1", 0), self.authkey)
        self.procs, self.store_dir = spawn_ranks(world_size, self.listener.address, self.authkey)

    def close(self, keep: tuple[int, ...] = ()) -> None:
        """Kill every process but those of the ranks in `keep` (taken by `take_ranks`)."""
        others = [proc for rank, proc in enumerate(self.procs) if rank not in keep]
        for proc in others:
            if proc.poll() is None:
                proc.kill()
        for proc in others:
            proc.wait(timeout=KILL_WAIT_S)
        self.listener.close()
        remove(self.store_dir)

    def take_ranks(
        self, ranks: set[int], deadline: float
    ) -> dict[int, tuple[subprocess.Popen, Channel]]:
        """The processes of `ranks`, connected, to replace those ranks of a running world; the
        others are killed (a standby world is taken whole or not at all: the next standby is
        started afresh)."""
        try:
            got = gather_ranks(
                self.listener, {r: self.procs[r] for r in ranks}, deadline, "standby"
            )
        except BaseException:
            self.close()
            raise
        self.close(keep=tuple(ranks))
        return {rank: (self.procs[rank], got[rank]) for rank in ranks}


def gather_ranks(
    listener: RankListener, procs: Mapping[int, subprocess.Popen], deadline: float, what: str
) -> dict[int, Channel]:
    """One authenticated connection from each process of `procs`, by the rank its Hello names
    (any other connection is closed). A WorkerError naming `what` when one of them exits or the
    deadline passes first, the connections gathered so far closed."""
    got: dict[int, Channel] = {}
    try:
        while len(got) < len(procs):
            item = listener.get(timeout=0.2)
            if item is not None:
                hello, conn = item
                if hello.rank in procs and hello.rank not in got:
                    got[hello.rank] = conn
                else:
                    conn.close()
            exited = sorted(rank for rank, proc in procs.items() if proc.poll() is not None)
            if exited:
                raise WorkerError(
                    f"{what} process(es) of rank(s) {exited} exited before connecting"
                )
            if time.monotonic() > deadline:
                missing = sorted(set(procs) - set(got))
                raise WorkerError(f"{what} rank(s) {missing} did not connect in time")
    except BaseException:
        for conn in got.values():
            conn.close()
        raise
    return got


class StandbyWorlds:
    """At most one Standby per world size, kept while `enabled` (serve.py: when failed worlds
    are restarted in place). A built-in world takes the one of its size and starts the next."""

    def __init__(self) -> None:
        self.enabled = False
        self._lock = threading.Lock()
        self._worlds: dict[int, Standby] = {}

    def take(self, world_size: int) -> Standby | None:
        with self._lock:
            return self._worlds.pop(world_size, None)

    def replenish(self, world_size: int) -> None:
        with self._lock:
            if self.enabled and world_size not in self._worlds:
                self._worlds[world_size] = Standby(world_size)

    def close(self) -> None:
        with self._lock:
            worlds, self._worlds, self.enabled = list(self._worlds.values()), {}, False
        for standby in worlds:
            standby.close()


STANDBY = StandbyWorlds()


def spawn_ranks(
    world: int, address: tuple[str, int], authkey: bytes
) -> tuple[list[subprocess.Popen], str]:
    """The processes of a world on this host and the directory of their rendezvous store: a
    FileStore in a directory of this user's alone (0700), which the world removes at shutdown
    (frontend_files.py: named after this process, so that one left by a killed frontend goes)."""
    store_dir = make_store_dir()
    procs = []
    try:
        for rank in range(world):
            procs.append(spawn_rank(rank, world, address, authkey, store_dir))
    except BaseException:
        for proc in procs:
            proc.kill()
        remove(store_dir)
        raise
    return procs, store_dir


def spawn_rank(
    rank: int, world: int, address: tuple[str, int], authkey: bytes, store_dir: str
) -> subprocess.Popen:
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        AFDSERVE_FRONTEND=f"{address[0]}:{address[1]}",
        AFDSERVE_AUTHKEY=authkey.hex(),
        AFDSERVE_STORE_PATH=os.path.join(store_dir, "store"),
        # The rank stops waiting for this frontend once it is no longer its parent.
        AFDSERVE_FRONTEND_PID=str(os.getpid()),
    )
    env.pop("AFDSERVE_AUTHKEY_FILE", None)
    return subprocess.Popen(
        [sys.executable, "-m", "afdserve.afd.ranks.worker"], env=env, stdin=subprocess.DEVNULL
    )


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
        self.key_file: str | None = None  # written for ranks started elsewhere, if no key given
        self.spawned = spawn
        self.generation = 0  # bumped each time the world is rebuilt around its survivors
        self.parted: set[int] = set()  # ranks that said Parted in this generation
        standby = STANDBY.take(self.world) if spawn else None
        key = read_key()
        if standby is not None:  # processes started ahead: they are connecting already
            self.authkey, self.listener, self.procs, self.store_dir = (
                standby.authkey,
                standby.listener,
                standby.procs,
                standby.store_dir,
            )
            log.info("starting the world on %d standby rank processes", self.world)
        else:
            self.authkey = key if key is not None else os.urandom(32)
            self.listener = RankListener(frontend_address, self.authkey)
        self.address = self.listener.address
        try:
            if spawn and standby is None:
                self.procs, self.store_dir = spawn_ranks(self.world, self.address, self.authkey)
            elif not spawn:
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
        if spawn:
            try:  # the next world's processes, while this one serves
                STANDBY.replenish(self.world)
            except OSError:  # no processes to spare (limits): a restart spawns its own
                log.warning("could not start standby rank processes", exc_info=True)

    def _where_the_key_is(self, given: bool) -> str:
        """Ranks started elsewhere need the key: say where it is, never what it is."""
        if given:
            source = (
                "AFDSERVE_AUTHKEY"
                if os.environ.get("AFDSERVE_AUTHKEY")
                else (f"AFDSERVE_AUTHKEY_FILE={os.environ['AFDSERVE_AUTHKEY_FILE']}")
            )
            return f"they authenticate with the key from {source}"
        self.key_file = write_key_file(self.authkey)  # mode 0600, removed at shutdown
        return (
            f"a fresh key was written to {self.key_file} (mode 0600): start the ranks with "
            f"AFDSERVE_AUTHKEY_FILE={self.key_file}"
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
                if isinstance(msg, Parted):  # a survivor that could not join the new generation
                    raise WorkerError(f"rank {msg.rank} could not rejoin:\n{msg.reason}")
                if isinstance(msg, Lost):
                    self.check_alive("during start-up")
                    raise WorkerError(f"rank {msg.rank} disconnected during start-up")
                if isinstance(msg, RankReady):
                    self.ready[msg.rank] = msg
                    log.info("%s", msg.memory.line())
                    if msg.generation:
                        log.info(
                            "rank %d (pid %d) joined world generation %d; weights loaded "
                            "%d time(s) by this process",
                            msg.rank,
                            self.procs[msg.rank].pid if self.procs else -1,
                            msg.generation,
                            msg.loads,
                        )
            self.check_alive("during start-up")
            stopped = [
                rank
                for rank, proc in enumerate(self.procs)
                if self.generation and process_stopped(proc.pid)
            ]
            if stopped:  # a rebuild must not wait out the start-up timeout on a stopped rank
                raise WorkerError(
                    f"rank(s) {stopped} stopped while joining generation {self.generation}"
                )
            if time.monotonic() > deadline:
                raise WorkerError("ranks not ready before the start-up timeout")
        now = time.monotonic()
        self.last_heard = {rank: now for rank in self.ready if self.ready[rank].limits}

    def messages(self, timeout: float, waker: Waker | None = None) -> list:
        """Every message waiting from any rank (a broken connection becomes `Lost`); the wait
        ends early when `waker` is woken (then drained)."""
        msgs: list = []
        watched: list = [*self.conns.values(), *([waker] if waker is not None else [])]
        for conn in wait(watched, timeout=timeout):
            if conn is waker:
                waker.drain()
                continue
            rank = next(r for r, c in self.conns.items() if c is conn)
            try:
                while conn.poll():
                    msg = conn.recv()
                    msgs.append(msg)
                    if isinstance(msg, Outputs) and rank in self.last_heard:  # attention
                        self.last_heard[rank] = time.monotonic()
                    elif isinstance(msg, Parted):
                        self.parted.add(rank)
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
        that stays silent is stuck (or a rank it waits on is): the world has stopped.

        Silence does not say which rank hangs: every rank waits on a stopped one within a step,
        and the FFN ranks never report. So the error names the ranks whose process is stopped
        (SIGSTOP, a debugger: /proc says so) when there are any, and otherwise the silent
        attention ranks, as what was seen and not as the culprit."""
        now = time.monotonic()
        silent = {
            rank: now - heard for rank, heard in self.last_heard.items() if now - heard > timeout_s
        }
        if not silent:
            return
        longest = max(silent.values())
        stopped = [rank for rank, proc in enumerate(self.procs) if process_stopped(proc.pid)]
        if stopped:
            names = ", ".join(f"{self._role(rank)} rank {rank}" for rank in stopped)
            raise WorkerError(
                f"{names} stopped (its process is in the stopped state): the world made no "
                f"progress for {longest:.1f} s (heartbeat_timeout_s={timeout_s})"
            )
        ranks = ", ".join(str(rank) for rank in sorted(silent))
        raise WorkerError(
            f"the world made no progress for {longest:.1f} s (heartbeat_timeout_s={timeout_s}): "
            f"attention rank(s) {ranks} sent nothing; a rank is hung (every rank waits on it)"
        )

    def _role(self, rank: int) -> str:
        return "attention" if self.spec.topology.is_attention(rank) else "FFN"

    def send(self, rank: int, message) -> None:
        self.conns[rank].send(message)

    def send_many(self, rank: int, messages: Iterable[object]) -> None:
        self.conns[rank].send_many(messages)

    def nudge(self, ranks: Iterable[int]) -> None:
        """A `Nudge` to each of `ranks`, best effort: a rank whose channel is gone or broken
        is left to `messages` and `check_alive` to report."""
        for rank in ranks:
            conn = self.conns.get(rank)
            if conn is not None:
                try:
                    conn.send(Nudge())
                except OSError:
                    pass

    # ----- rebuilding a broken world around its survivors -----
    def failed_ranks(self) -> set[int]:
        """Ranks that cannot rejoin: their process exited or is stopped, or its channel broke."""
        return {
            rank
            for rank, proc in enumerate(self.procs)
            if proc.poll() is not None or process_stopped(proc.pid) or rank not in self.conns
        }

    def kill_failed(self) -> set[int]:
        """SIGKILL the failed ranks now: a stopped (hung) one must be gone before a replacement
        takes its rank, and its death closes its sockets, which unblocks the peers waiting on it."""
        failed = self.failed_ranks()
        for rank in failed:
            proc = self.procs[rank]
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                log.error("rank process %d did not exit after SIGKILL", proc.pid)
            conn = self.conns.pop(rank, None)
            if conn is not None:
                conn.close()
        return failed

    def rebuild(self) -> set[int]:
        """The world broke while serving: kill the failed ranks, wait until every other rank
        has left the broken generation (`Parted`), start a replacement for each failed rank (a
        standby process where there is one), and have survivors and replacements join the
        next generation through a fresh store file. Survivors keep their halves and KV caches;
        only replacements load weights. Returns the ranks replaced; WorkerError when the world
        cannot be rebuilt this way (the caller restarts it whole)."""
        if not self.spawned or self.store_dir is None:
            raise WorkerError("ranks started elsewhere are not replaced by the frontend")
        failed = self.kill_failed()
        survivors = set(range(self.world)) - failed
        if not failed:  # silence without a culprit (the heartbeat): no rank to replace
            raise WorkerError("no rank process exited or stopped: which one hangs is unknown")
        if not survivors:
            raise WorkerError("no rank survived")
        deadline = time.monotonic() + PART_TIMEOUT_S
        while survivors - self.parted:
            for msg in self.messages(0.2):
                if isinstance(msg, RankFailed):
                    raise WorkerError(f"rank {msg.rank} failed:\n{msg.traceback}")
                if isinstance(msg, Lost):
                    raise WorkerError(f"rank {msg.rank} disconnected while the world broke")
            gone = sorted(self.failed_ranks() & survivors)
            if gone:
                raise WorkerError(f"rank(s) {gone} failed too while the world broke")
            if time.monotonic() > deadline:
                stuck = sorted(survivors - self.parted)
                raise WorkerError(
                    f"rank(s) {stuck} did not leave the broken world within {PART_TIMEOUT_S:g} s"
                )
        generation = self.generation + 1
        store_path = os.path.join(self.store_dir, f"store.{generation}")
        start_deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank, (proc, conn) in self._replacements(failed, start_deadline).items():
            self.procs[rank], self.conns[rank] = proc, conn
            conn.send(dataclasses.replace(self.spec, store_path=store_path, generation=generation))
        for rank in sorted(survivors):
            self.send(rank, Rejoin(generation, store_path))
        self.generation, self.parted, self.ready = generation, set(), {}
        log.info(
            "world generation %d: rank(s) %s replaced, rank(s) %s rejoin with their weights",
            generation,
            sorted(failed),
            sorted(survivors),
        )
        self._wait_ready(start_deadline)
        return failed

    def _replacements(
        self, ranks: set[int], deadline: float
    ) -> dict[int, tuple[subprocess.Popen, Channel]]:
        """A connected process for each of `ranks`: a standby world's (imports done), or fresh."""
        standby = STANDBY.take(self.world)
        if standby is not None:
            return standby.take_ranks(ranks, deadline)
        listener = RankListener(("127.0.0.1", 0), self.authkey)
        procs: dict[int, subprocess.Popen] = {}
        try:
            for rank in ranks:
                procs[rank] = spawn_rank(
                    rank, self.world, listener.address, self.authkey, self.store_dir or ""
                )
            got = gather_ranks(listener, procs, deadline, "replacement")
        except BaseException:
            for proc in procs.values():
                proc.kill()
                proc.wait(timeout=KILL_WAIT_S)
            raise
        finally:
            listener.close()
        return {rank: (procs[rank], got[rank]) for rank in ranks}

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
        for path in (self.store_dir, self.key_file):
            if path is not None:
                remove(path)

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
