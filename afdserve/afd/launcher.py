"""Starts every rank as a local process (env:// rendezvous on a free port), routes each request to
the attention rank with the fewest outstanding tokens, gathers outputs, and shuts all ranks down,
leaving no process behind, also when a rank fails during start-up.

Ranks talk to this frontend over authenticated local connections: the frontend listens, each rank
connects, receives its WorkerSpec, and reports back. With `spawn=False` the frontend only listens,
so ranks started elsewhere (torchrun, Slurm) join it the same way.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, Listener, wait

from afdserve.afd.messages import (
    AbortRequest,
    AddRequest,
    Hello,
    Outputs,
    RankFailed,
    RankReady,
    RankStats,
    Rejected,
    Shutdown,
    WorkerSpec,
)
from afdserve.engine.client import EngineClient, EngineStats
from afdserve.engine.engine_core import RequestError, RequestLimits, RequestOutput, check_request
from afdserve.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
JOIN_TIMEOUT_S = 20.0


class WorkerError(RuntimeError):
    """A rank failed; carries the rank's own traceback."""


class _Lost:
    """The connection to a rank broke (frontend-side only, never sent)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessClient(EngineClient):
    def __init__(
        self,
        spec: WorkerSpec,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        spawn: bool = True,
        frontend_address: tuple[str, int] = ("127.0.0.1", 0),
    ) -> None:
        self.spec = spec
        topology = spec.topology
        self.world = topology.world_size
        self.closed = False
        self.procs: list[subprocess.Popen] = []
        self.conns: dict[int, Connection] = {}
        self.ready: dict[int, RankReady] = {}
        self.owner: dict[str, int] = {}  # request id -> attention rank
        self.cost: dict[str, int] = {}
        self.outstanding = [0] * topology.attention_ranks
        self.rank_stats: dict[int, RankStats] = {}
        self._carried: list[RequestOutput] = []
        key = os.environ.get("AFDSERVE_AUTHKEY")
        self.authkey = bytes.fromhex(key) if key else os.urandom(16)
        self.listener = Listener(frontend_address, authkey=self.authkey)
        self.address = self.listener.address
        try:
            if spawn:
                self._spawn()
            else:
                log.info(
                    "waiting for %d ranks at %s:%d (AFDSERVE_AUTHKEY=%s)",
                    self.world,
                    *self.address,
                    self.authkey.hex(),
                )
            self._accept(startup_timeout_s)
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        limits = [info.limits for info in self.ready.values() if info.limits is not None]
        self.limits = RequestLimits(
            min(lim.max_model_len for lim in limits),
            limits[0].vocab_size,
            min(lim.num_blocks for lim in limits),
            limits[0].block_size,
        )
        self.max_model_len, self.vocab_size = self.limits.max_model_len, self.limits.vocab_size

    def _spawn(self) -> None:
        master_port = free_port()
        for rank in range(self.world):
            env = dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(master_port),
                WORLD_SIZE=str(self.world),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                AFDSERVE_FRONTEND=f"{self.address[0]}:{self.address[1]}",
                AFDSERVE_AUTHKEY=self.authkey.hex(),
            )
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "afdserve.afd.worker"],
                    env=env,
                    stdin=subprocess.DEVNULL,
                )
            )

    def _accept(self, timeout_s: float) -> None:
        accepted: list[Connection] = []
        done = threading.Event()

        def accept_all() -> None:
            try:
                while len(accepted) < self.world:
                    accepted.append(self.listener.accept())
            except OSError:
                pass
            done.set()

        threading.Thread(target=accept_all, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not done.wait(0.2):
            self._check_alive("during start-up")
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"only {len(accepted)} of {self.world} ranks connected within {timeout_s:.0f} s"
                )
        for conn in accepted:
            hello = conn.recv()
            if not isinstance(hello, Hello):
                raise WorkerError(f"a rank opened with {type(hello).__name__}, not Hello")
            self.conns[hello.rank] = conn
            conn.send(self.spec)

    def _messages(self, timeout: float) -> list:
        msgs = []
        for conn in wait(list(self.conns.values()), timeout=timeout):
            try:
                while conn.poll():
                    msgs.append(conn.recv())
            except (EOFError, OSError):
                rank = next(r for r, c in self.conns.items() if c is conn)
                self.conns.pop(rank)
                msgs.append(_Lost(rank))
        return msgs

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.ready) < self.world:
            for msg in self._messages(0.2):
                if isinstance(msg, RankFailed):
                    raise WorkerError(f"rank {msg.rank} failed during start-up:\n{msg.traceback}")
                if isinstance(msg, _Lost):
                    self._check_alive("during start-up")
                    raise WorkerError(f"rank {msg.rank} disconnected during start-up")
                if isinstance(msg, RankReady):
                    self.ready[msg.rank] = msg
                    log.info("%s", msg.memory.line())
            self._check_alive("during start-up")
            if time.monotonic() > deadline:
                raise WorkerError(f"ranks not ready after {timeout_s:.0f} s")

    def _check_alive(self, when: str) -> None:
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                raise WorkerError(
                    f"rank {rank} exited {when} with code {code} (its error is printed above)"
                )

    # ----- EngineClient -----
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        if request_id in self.owner:
            raise RequestError(f"request_id: {request_id!r} is already running")
        check_request(prompt_token_ids, params, self.limits)
        rank = min(range(len(self.outstanding)), key=lambda r: (self.outstanding[r], r))
        cost = len(prompt_token_ids) + params.max_tokens
        self.owner[request_id], self.cost[request_id] = rank, cost
        self.outstanding[rank] += cost
        self.conns[rank].send(AddRequest(request_id, tuple(prompt_token_ids), params))

    def abort(self, request_id: str) -> None:
        rank = self.owner.get(request_id)
        if rank is not None:
            self.conns[rank].send(AbortRequest(request_id))
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        rank = self.owner.pop(request_id, None)
        if rank is not None:
            self.outstanding[rank] -= self.cost.pop(request_id)

    def step(self) -> list[RequestOutput]:
        if self.closed:
            raise WorkerError("the engine is shut down")
        results, self._carried = self._carried, []
        rejected: RequestError | None = None
        for msg in self._messages(0.0 if results else 0.05):
            if isinstance(msg, Outputs):
                self.rank_stats[msg.rank] = msg.stats
                for out in msg.outputs:
                    if out.request_id not in self.owner:
                        continue  # aborted meanwhile
                    results.append(out)
                    if out.finished:
                        self._forget(out.request_id)
            elif isinstance(msg, Rejected):  # a rank refused what passed the frontend's checks
                self._forget(msg.request_id)
                rejected = RequestError(msg.message, msg.request_id)
            elif isinstance(msg, (RankFailed, _Lost)):
                detail = msg.traceback if isinstance(msg, RankFailed) else "connection lost"
                self.shutdown()
                raise WorkerError(f"rank {msg.rank} failed:\n{detail}")
        if rejected is not None:
            self._carried = results  # handed out by the next step()
            raise rejected
        if not results:
            try:
                self._check_alive("while serving")
            except WorkerError:
                self.shutdown()
                raise
        return results

    @property
    def has_unfinished(self) -> bool:
        return bool(self.owner)

    def stats(self) -> EngineStats:
        stats = EngineStats()
        ranks = max(len(self.outstanding), 1)
        for rank_stats in self.rank_stats.values():
            stats.running += rank_stats.running
            stats.waiting += rank_stats.waiting
            stats.kv_cache_usage += rank_stats.kv_cache_usage / ranks
            for mode, count in rank_stats.steps.items():
                stats.steps[mode] = stats.steps.get(mode, 0) + count
        return stats

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        for rank in range(len(self.outstanding)):
            conn = self.conns.get(rank)
            if conn is not None:
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
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        for conn in self.conns.values():
            conn.close()
        self.listener.close()
