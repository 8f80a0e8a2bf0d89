"""Role workers: one process per rank, joined in one torch.distributed world through env://.

Attention rank: scheduler, KV cache, attention half, sampler; sends at the FFN boundary of every
layer. FFN rank: the FFN half only; each step it loops recv -> FFN -> send as the plan says.
Every step starts with the control-plane all-gather, so all ranks plan the same step.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Client, Connection

import torch
import torch.distributed as dist

from afdserve.afd.connector import AttentionConnector, FFNExchange
from afdserve.afd.control import ControlPlane
from afdserve.afd.graphs import StepRecorder
from afdserve.afd.plan import capture_reports
from afdserve.afd.topology import Topology
from afdserve.config import AFDConfig, EngineConfig, GraphConfig
from afdserve.engine.engine_core import RequestError
from afdserve.engine.factory import MemoryReport, create_engine_core, half_parts, parameter_bytes
from afdserve.engine.model_runner import LocalFFN
from afdserve.engine.scheduler import SchedulerOutput
from afdserve.model.loader import load_model

log = logging.getLogger("afdserve.worker")

# Idle ranks back off from 1 ms to 20 ms between control rounds: a new request waits at most one
# round, and idle worlds do not keep every core busy.
IDLE_SLEEP_S = (0.001, 0.020)
CONNECT_TIMEOUT_S = 300.0
STATS_EVERY_STEPS = 64


@dataclass(frozen=True)
class WorkerSpec:
    engine: EngineConfig
    afd: AFDConfig
    graphs: GraphConfig
    log_path: str | None = None
    threads: int = 1

    @property
    def topology(self) -> Topology:
        return self.afd.parsed_topology


def rank_device(spec: WorkerSpec, rank: int) -> torch.device:
    if spec.engine.device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", rank))
        return torch.device("cuda", local % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def init_world(spec: WorkerSpec, rank: int) -> tuple[dist.ProcessGroup, torch.device]:
    device = rank_device(spec, rank)
    timeout = timedelta(seconds=spec.afd.timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl",
            rank=rank,
            world_size=spec.topology.world_size,
            timeout=timeout,
            device_id=device,
        )
    else:
        dist.init_process_group(
            "gloo", rank=rank, world_size=spec.topology.world_size, timeout=timeout
        )
    return dist.new_group(backend="gloo", timeout=timeout), device


def worker_main(rank: int, conn: Connection) -> None:
    """Entry point of one rank. The frontend sends the WorkerSpec over `conn`, then requests; the
    rank answers with ready / outputs / rejected / error messages. MASTER_ADDR, MASTER_PORT,
    WORLD_SIZE and RANK come from the environment (the launcher or torchrun sets them)."""
    conn.send(("hello", rank))
    spec: WorkerSpec = conn.recv()
    logging.basicConfig(level=logging.INFO, format=f"[afdserve rank {rank}] %(message)s")
    torch.set_num_threads(spec.threads)
    try:
        control_group, device = init_world(spec, rank)
        if spec.topology.is_attention(rank):
            AttentionRank(spec, rank, device, control_group, conn).serve()
        else:
            FFNRank(spec, rank, device, control_group, conn).serve()
    except BaseException:
        try:
            conn.send(("error", rank, traceback.format_exc()))
        except OSError:
            pass
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    """`python -m afdserve.afd.worker`: one rank, under the launcher or torchrun.
    AFDSERVE_FRONTEND=host:port and AFDSERVE_AUTHKEY (hex) say where the frontend listens."""
    host, port = os.environ["AFDSERVE_FRONTEND"].rsplit(":", 1)
    authkey = bytes.fromhex(os.environ["AFDSERVE_AUTHKEY"])
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:  # under torchrun a rank may start before the frontend listens
        try:
            conn = Client((host, int(port)), authkey=authkey)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    try:
        worker_main(int(os.environ["RANK"]), conn)
    except BaseException:
        sys.exit(1)
    finally:
        conn.close()


def _recorder(spec: WorkerSpec, role: str, rank: int) -> StepRecorder:
    sizes = spec.graphs.capture_sizes(spec.engine.max_num_seqs)
    return StepRecorder(
        role, rank, spec.graphs.mode, sizes, spec.log_path, ubatches=spec.afd.ubatches
    )


class AttentionRank:
    def __init__(
        self, spec: WorkerSpec, rank: int, device: torch.device, control_group, conn: Connection
    ) -> None:
        self.spec, self.rank, self.topology, self.conn = spec, rank, spec.topology, conn
        self.core, _, memory = create_engine_core(
            spec.engine,
            half_parts(
                "attention" if self.topology.ffn_ranks else "colocated", spec.afd.gate_on_attention
            ),
            rank,
        )
        self.memory = memory
        log.info("%s", memory.line())
        self.control = ControlPlane(self.topology, control_group)
        self.recorder = _recorder(spec, "attention", rank)
        if self.topology.colocated:
            self.boundary = LocalFFN(self.core.model)
        else:
            dtype = next(self.core.model.parameters()).dtype
            self.boundary = AttentionConnector(self.core.config.hidden_size, dtype, device)

    def _ready_info(self) -> dict:
        core = self.core
        return {
            "role": "attention",
            "rank": self.rank,
            "memory": self.memory,
            "tensor_names": sorted(core.model.expected_tensors()),
            "limits": core.limits,
        }

    def _warmup(self) -> None:
        for size in sorted(self.recorder.table.sizes, reverse=True):
            plan = self.recorder.plan(capture_reports(size, self.topology), self.topology)
            self._execute(SchedulerOutput([], []), plan.attention[self.rank])
            self.recorder.record(plan)

    def _execute(self, out: SchedulerOutput, mine):
        if isinstance(self.boundary, AttentionConnector):
            self.boundary.begin_step(mine, self.recorder.step)
        return self.core.execute(out, mine, self.boundary)

    def _drain(self) -> bool:
        """Apply queued frontend commands; True when shutdown was asked for."""
        while self.conn.poll():
            try:
                msg = self.conn.recv()
            except EOFError:  # the frontend is gone: stop every rank
                return True
            if msg[0] == "add":
                _, request_id, prompt, params = msg
                try:
                    self.core.add_request(request_id, prompt, params)
                except RequestError as e:
                    self.conn.send(("rejected", self.rank, request_id, str(e)))
            elif msg[0] == "abort":
                self.core.abort(msg[1])
            elif msg[0] == "shutdown":
                return True
        return False

    def _stats(self) -> tuple:
        s = self.core.scheduler
        return (
            s.num_running,
            s.num_waiting,
            self.core.block_manager.usage,
            dict(self.recorder.mode_counts),
        )

    def serve(self) -> None:
        self._warmup()
        self.conn.send(("ready", self.rank, self._ready_info()))
        idle_sleep = IDLE_SLEEP_S[0]
        while True:
            shutdown = self._drain()
            out, report = self.core.schedule()
            round_ = self.control.exchange(report, shutdown)
            if round_.shutdown:
                return
            plan = self.recorder.plan(round_.reports, self.topology)
            mine = plan.attention[self.rank]
            results = self._execute(out, mine) if mine.mode != "idle" else []
            self.recorder.record(plan)
            if results or self.recorder.step % STATS_EVERY_STEPS == 0:
                self.conn.send(("outputs", self.rank, results, self._stats()))
            if plan.has_work:
                idle_sleep = IDLE_SLEEP_S[0]
            else:
                time.sleep(idle_sleep)
                idle_sleep = min(idle_sleep * 2, IDLE_SLEEP_S[1])


class FFNRank:
    def __init__(
        self, spec: WorkerSpec, rank: int, device: torch.device, control_group, conn: Connection
    ) -> None:
        self.spec, self.rank, self.topology, self.conn = spec, rank, spec.topology, conn
        model, _ = load_model(
            spec.engine.model,
            half_parts("ffn", spec.afd.gate_on_attention),
            spec.engine.dtype,
            str(device),
        )
        self.model = model
        dtype = next(model.parameters()).dtype
        self.exchange = FFNExchange(
            model,
            rank,
            model.config.vocab_size,
            model.config.top_k,
            spec.afd.gate_on_attention,
            dtype,
            device,
        )
        self.control = ControlPlane(self.topology, control_group)
        self.recorder = _recorder(spec, "ffn", rank)
        self.memory = MemoryReport(
            "ffn", rank, parameter_bytes(model), 0, len(model.expected_tensors())
        )
        log.info("%s", self.memory.line())

    def _run(self, plan) -> None:
        mine = plan.for_rank(self.rank)
        if mine.mode != "idle":
            self.exchange.run_step(mine, self.recorder.step)
        self.recorder.record(plan)

    def serve(self) -> None:
        for size in sorted(self.recorder.table.sizes, reverse=True):
            self._run(self.recorder.plan(capture_reports(size, self.topology), self.topology))
        self.conn.send(
            (
                "ready",
                self.rank,
                {
                    "role": "ffn",
                    "rank": self.rank,
                    "memory": self.memory,
                    "tensor_names": sorted(self.model.expected_tensors()),
                    "limits": None,
                },
            )
        )
        while True:
            round_ = self.control.exchange(None)
            if round_.shutdown:
                return
            self._run(self.recorder.plan(round_.reports, self.topology))


if __name__ == "__main__":
    main()
