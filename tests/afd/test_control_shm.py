"""The shared-memory control plane over real processes: every rank sees every other rank's exact
report in every round however the ranks drift apart, shutdown stops all ranks at one round, the
board leaves nothing in /dev/shm, and a rank that exits or never arrives is named, not waited on."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from datetime import timedelta

import pytest

from afdserve.afd.step.control_shm import shared_memory_supported
from afdserve.config import AFDConfig
from afdserve.frontend.process import free_port
from afdserve.layout.plan import RankStep
from afdserve.layout.topology import Topology

pytestmark = pytest.mark.skipif(not shared_memory_supported(), reason="x86-64 Linux only")

ROUNDS = 300


def _report(rank: int, round_: int, topology: Topology) -> RankStep | None:
    """The oracle: a rank's report is a function of (rank, round) alone."""
    if not topology.is_attention(rank):
        return None
    if (round_ + rank) % 11 == 0:
        return RankStep(0, 0, False)
    reqs, uniform = 1 + (round_ + rank) % 5, (round_ * 3 + rank) % 2 == 0
    return RankStep(reqs if uniform else reqs + round_ * 7 + rank, reqs, uniform)


def _drift(rank: int, arg: int, rng: random.Random, timeout_s: float, control):
    """Rounds with random pauses between them (none, a few microseconds, a few milliseconds),
    so a fast rank keeps starting round n+1 while a slow one still reads round n."""
    topology = control.topology
    stopper = ROUNDS % topology.world_size
    for n in range(1, ROUNDS + 1):
        pause = rng.choice([0.0, 0.0, 0.0, 1e-5, 1e-4, 2e-3])
        if pause:
            time.sleep(pause)
        got = control.exchange(_report(rank, n, topology), shutdown=rank == stopper and n == ROUNDS)
        want = tuple(_report(r, n, topology) for r in range(topology.attention_ranks))
        if got.reports != want or got.shutdown != (n == ROUNDS):
            return f"round {n}: got {got}, want {want} (shutdown={n == ROUNDS})"
    # Round 1 completed, so rank 0 had unlinked the name: only the mappings hold the board.
    with open("/proc/self/maps") as f:
        if f"{control.path} (deleted)" not in f.read():
            return f"{control.path} is not mapped as a deleted file"
    return None


def _absent(rank: int, arg: int, rng: random.Random, timeout_s: float, control):
    """The last rank exits at once (arg 1) or never takes part (arg 2)."""
    last = control.topology.world_size - 1
    if rank == last:
        if arg == 1:
            os._exit(0)
        time.sleep(timeout_s + 3)
        return None
    start = time.monotonic()
    try:
        control.exchange(_report(rank, 1, control.topology))
    except RuntimeError as e:
        return (type(e).__name__, str(e), time.monotonic() - start)
    return "no error"


def _rank(
    rank: int, topology: Topology, port: int, scenario, arg: int, timeout_s: float, results
) -> None:
    import torch.distributed as dist

    from afdserve.afd.step.control_shm import SharedMemoryControl

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=topology.world_size, timeout=timedelta(seconds=120)
    )
    control = SharedMemoryControl(topology, dist.new_group(backend="gloo"), rank, timeout_s)
    try:
        outcome = scenario(rank, arg, random.Random(rank), timeout_s, control)
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        outcome = f"rank {rank} raised {e!r}"
    results.put((rank, outcome, control.path))
    control.close()


def _world(
    topology: Topology, scenario, arg: int = 0, timeout_s: float = 60.0, ranks: int | None = None
) -> dict[int, tuple]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, topology, port, scenario, arg, timeout_s, results))
        for r in range(topology.world_size)
    ]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in range(ranks if ranks is not None else len(procs)):
            rank, outcome, path = results.get(timeout=240)
            got[rank] = (outcome, path)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


def test_every_rank_sees_every_report_of_every_round():
    topology = Topology(3, 1)
    got = _world(topology, _drift)
    assert {rank: outcome for rank, (outcome, _) in got.items()} == dict.fromkeys(range(4))
    paths = {path for _, path in got.values()}
    assert len(paths) == 1
    assert not os.path.exists(paths.pop())


def test_a_rank_that_exits_is_named_at_once():
    got = _world(Topology(2, 1), _absent, arg=1, timeout_s=60.0, ranks=2)
    for rank in (0, 1):
        kind, message, waited = got[rank][0]
        assert kind == "ControlPlaneError"
        assert f"control round 1 on rank {rank}: rank 2 (pid " in message
        assert message.endswith("exited")
        assert waited < 5.0


def test_a_rank_that_never_arrives_times_out_by_name():
    got = _world(Topology(2, 1), _absent, arg=2, timeout_s=1.0, ranks=2)
    for rank in (0, 1):
        kind, message, waited = got[rank][0]
        assert kind == "ControlPlaneError"
        assert message == (
            f"control round 1 on rank {rank}: ranks [2] did not arrive within "
            f"timeout_s=1.0 (hung or stopped)"
        )
        assert 1.0 <= waited < 5.0


def test_control_plane_choice_is_checked():
    with pytest.raises(
        ValueError,
        match=r"AFDConfig.control_plane='nccl' is not allowed: "
        r"one of \('auto', 'gloo', 'shm'\)",
    ):
        AFDConfig(topology="2A1F", control_plane="nccl")
