"""The control plane of a one-host world, in shared memory: the same rounds as the gloo all-gather
(control.py), without a socket round trip per rank and step.

The board is one file in /dev/shm (POSIX shared memory on Linux), int64 words:

    line 0             [token, 0...]               token: a random number rank 0 writes; every
                                                   rank checks it to know it opened this board
    board 0, board 1   one 64-byte line per rank:  [round, num_tokens, num_reqs, uniform_decode,
                                                    shutdown, 0, 0, 0]

A round n: rank r writes its fields into its slot of board n % 2, then the round number n into
the slot's first word, then waits until every slot of that board holds n, then copies every slot.
Why that is safe on x86-64 only: `shared_memory_supported`; why two boards are enough:
`SharedMemoryControl.exchange`. Rank 0 unlinks the file once every rank has mapped it, so only a
crash inside the start-up handshake can leave an `afdserve-control-*` file behind.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import time

import torch.distributed as dist

from afdserve.engine.control_round import FIELDS, ControlRound, decode, encode
from afdserve.layout.plan import RankStep
from afdserve.layout.topology import Topology

SHM_DIR = "/dev/shm"
PREFIX = "afdserve-control-"
LINE = 8  # int64 words per 64-byte cache line: one slot per line, so no two ranks write one line
# A waiting rank spins this long before it sleeps: with more ranks than cores (tests run 4-rank
# worlds on 2 cores) a longer spin steals the core the awaited rank needs.
SPIN_S = 5e-6
# ... and this long while the world has work and every rank has a core of its own: an FFN rank
# that launched its step asynchronously waits about a whole step for the next round, and a
# sleeping rank wakes late by up to its sleep, which the next step would pay.
SPIN_BUSY_S = 0.02
SLEEP_S = (2e-5, 1e-3)  # then sleeps, doubling
LIVENESS_S = 0.1  # while sleeping, look this often for awaited ranks that exited


class ControlPlaneError(RuntimeError):
    """A control round could not complete: a rank exited, or did not arrive in time."""


def shared_memory_supported() -> bool:
    """x86-64 Linux only. The round number is what tells a reader the fields are there: x86-64
    (TSO) makes one core's stores visible to the others in program order, never reorders a load
    with an earlier load, and never lets a store pass an earlier load, so a reader that sees round
    n in a slot also sees the fields written before it, and a rank's reads of a round are done
    before its next round number is seen. Each word is one aligned 8-byte move (a memoryview
    item), never seen half-written, and each store is its own interpreter step, which no compiler
    reorders. A weaker memory model (ARM, POWER) would need release stores and acquire loads,
    which Python cannot express: no there, and "auto" stays on gloo."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _exited(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) still answers kill(0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return False


class SharedMemoryControl:
    def __init__(
        self, topology: Topology, group: dist.ProcessGroup, rank: int, timeout_s: float
    ) -> None:
        if not shared_memory_supported():
            raise ControlPlaneError(
                f"control_plane='shm' needs an x86-64 Linux host ({SHM_DIR} and x86 store "
                f"order), this is {platform.system()} {platform.machine()}: use 'gloo'"
            )
        self.topology, self.rank, self.timeout_s = topology, rank, timeout_s
        world = topology.world_size
        # [board][rank] -> word index of the slot's round number; line 0 holds the token
        self._slots = [[LINE + (b * world + r) * LINE for r in range(world)] for b in (0, 1)]
        self._round = 0
        self._busy = False
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        self._spin_busy_s = SPIN_BUSY_S if cores > world else SPIN_S
        self.path = ""  # the board's name in /dev/shm, unlinked once every rank mapped it
        self._pids: dict[int, int] = {}  # rank -> pid, of the other ranks this one can watch
        self._map, self._words = self._open(group, (1 + 2 * world) * LINE * 8)

    def _open(self, group: dist.ProcessGroup, size: int) -> tuple[mmap.mmap, memoryview]:
        """Rank 0 creates the board and names it to the others over the gloo group; every rank
        maps it and checks the token, and learns whether every other rank could."""
        shared: list = [None, 0, None]  # path, token, rank 0's error
        board: tuple[mmap.mmap, memoryview] | None = None
        if self.rank == 0:
            shared[0] = os.path.join(SHM_DIR, PREFIX + secrets.token_hex(8))
            shared[1] = secrets.randbits(62) + 1
            try:
                board = self._map_file(shared[0], size, create=True)
                board[1][0] = shared[1]
            except OSError as e:
                shared[2] = f"rank 0 could not create {shared[0]}: {e}"
        dist.broadcast_object_list(shared, src=0, group=group)
        path, token, error = shared
        self.path = path
        if error is None and self.rank != 0:
            try:
                board = self._map_file(path, size, create=False)
                if board[1][0] != token:
                    error = f"rank {self.rank} found another world's board at {path}"
            except OSError as e:
                error = f"rank {self.rank} could not open {path}: {e}"
        gathered: list = [None] * self.topology.world_size
        try:
            dist.all_gather_object(gathered, (error, os.getpid(), _pid_namespace()), group=group)
        finally:
            if self.rank == 0 and shared[2] is None:
                # Every rank has mapped it (or failed to): the name can go, the mappings
                # outlive it, and the kernel frees the memory when the last rank exits.
                os.unlink(path)
        # A pid means this process only in this rank's pid namespace (containers): ranks in
        # another one are left to the timeout.
        self._pids = {
            r: pid
            for r, (_, pid, space) in enumerate(gathered)
            if r != self.rank and space is not None and space == _pid_namespace()
        }
        failed = [e for e in dict.fromkeys(e for e, _, _ in gathered) if e is not None]
        if failed or board is None:
            if board is not None:
                board[1].release()
                board[0].close()
            raise ControlPlaneError(
                "control_plane='shm' needs every rank on one host, sharing /dev/shm: "
                + "; ".join(failed)
                + " (use control_plane='gloo' across hosts)"
            )
        return board

    @staticmethod
    def _map_file(path: str, size: int, create: bool) -> tuple[mmap.mmap, memoryview]:
        """The file opened directly, not through multiprocessing.shared_memory: before Python
        3.13 (no track=False) that registers every attach with a resource tracker, which
        complains about or unlinks a segment other processes still use (and processes started
        by multiprocessing share one tracker, whose bookkeeping is a set)."""
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise OSError(f"{path} holds {os.fstat(fd).st_size} bytes, expected {size}")
            board = mmap.mmap(fd, size)
        except OSError:
            if create:
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        return board, memoryview(board).cast("q")

    def exchange(self, report: RankStep | None, shutdown: bool = False) -> ControlRound:
        """One round: attention ranks pass their report; FFN ranks pass None.

        Two boards are enough (a slot is never overwritten while a rank still reads it): rank r
        writes round n into board n % 2 only after its round n-1 returned, that is after every
        rank published round n-1; a rank publishes round n-1 only after its round n-2 returned,
        and round n-2 returns only after it copied board n % 2. So when r overwrites its slot
        with round n, every rank has finished reading round n-2 from it; and a reader waiting on
        round n finds n-2 or n in a slot, never n+2: "the slot holds n" means round n's fields."""
        self._round += 1
        n, words = self._round, self._words
        slots = self._slots[n & 1]
        mine = slots[self.rank]
        for i, value in enumerate(encode(report, shutdown)):
            words[mine + 1 + i] = value
        words[mine] = n  # after the fields: x86 stores become visible in program order
        self._wait(n, slots)
        round_ = decode([words[s + 1 : s + 1 + FIELDS].tolist() for s in slots], self.topology)
        self._busy = any(r.num_tokens for r in round_.reports)
        return round_

    def _wait(self, n: int, slots: list[int]) -> None:
        words = self._words
        missing = [r for r, s in enumerate(slots) if words[s] < n]
        if not missing:
            return
        start = time.perf_counter()
        spin_s = self._spin_busy_s if self._busy else SPIN_S
        while missing and time.perf_counter() - start < spin_s:
            missing = [r for r in missing if words[slots[r]] < n]
        sleep, look_at = SLEEP_S[0], start + LIVENESS_S
        while missing:
            time.sleep(sleep)
            sleep = min(2 * sleep, SLEEP_S[1])
            missing = [r for r in missing if words[slots[r]] < n]
            now = time.perf_counter()
            if missing and now >= look_at:
                self._check(n, missing, now - start)
                look_at = now + LIVENESS_S

    def _check(self, n: int, missing: list[int], waited_s: float) -> None:
        gone = [
            f"rank {r} (pid {self._pids[r]})"
            for r in missing
            if r in self._pids and _exited(self._pids[r])
        ]
        if gone:
            raise ControlPlaneError(
                f"control round {n} on rank {self.rank}: {', '.join(gone)} exited"
            )
        if waited_s > self.timeout_s:
            raise ControlPlaneError(
                f"control round {n} on rank {self.rank}: ranks {missing} did not arrive within "
                f"timeout_s={self.timeout_s} (hung or stopped)"
            )

    def close(self) -> None:
        """Unmap the board (its name is long gone). Every exchange is over by now."""
        if not self._map.closed:
            self._words.release()
            self._map.close()
