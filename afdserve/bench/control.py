"""`afdserve bench control`: what the control plane costs per step. Every rank of a one-host world
runs the control round that precedes every step (the gloo all-gather, or the shared-memory board)
back to back; the median round is the per-step cost, to set against a decode step's time."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from afdserve.bench.flags import add_bench_flags
from afdserve.bench.report import invalid
from afdserve.config_args import build, option
from afdserve.layout.plan import RankStep
from afdserve.layout.topology import Topology

PLANES = ("gloo", "shm")


@dataclass(frozen=True)
class ControlBench:
    topology: str = option("1A1F", help="the world whose rounds are timed")
    control_planes: tuple[str, ...] | None = option(
        None,
        flag="--control-plane",
        choices=PLANES,
        repeat=True,
        shown="both",
        help="gloo or shm, repeatable",
    )
    rounds: int = option(500, help="control rounds timed per plane")

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise invalid(self, "rounds", "an integer >= 1")


def _rank(rank: int, topology: Topology, plane: str, port: int, rounds: int, results) -> None:
    from afdserve.afd.step.control import open_control_plane

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=topology.world_size, timeout=timedelta(seconds=120)
    )
    control = open_control_plane(
        plane, topology, dist.new_group(backend="gloo"), rank, 120.0, one_host=True
    )
    report = RankStep(64, 64, True) if topology.is_attention(rank) else None
    times = []
    for _ in range(rounds + 10):
        start = time.perf_counter()
        control.exchange(report)
        times.append(time.perf_counter() - start)
    results.put((rank, statistics.median(times[10:]) * 1e6))
    control.close()
    dist.destroy_process_group()


def measure_control_plane(
    topology: Topology, rounds: int = ControlBench.rounds, plane: str = "gloo"
) -> dict[int, float]:
    """Median microseconds of one control round, per rank."""
    from afdserve.frontend.process import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, topology, plane, port, rounds, results))
        for r in range(topology.world_size)
    ]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    return got


def add_control_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("control", help="time the per-step control-plane round")
    add_bench_flags(p, ControlBench)
    p.set_defaults(func=main_control)


def main_control(args: argparse.Namespace) -> int:
    topology = Topology.parse(args.topology)
    spec = build(ControlBench, args)
    for plane in spec.control_planes or PLANES:
        per_rank = measure_control_plane(topology, spec.rounds, plane)
        print(
            f"control plane {plane}, {topology}, {spec.rounds} rounds (median per round): "
            + ", ".join(f"rank {r} {us:.1f} us" for r, us in sorted(per_rank.items()))
        )
    return 0
