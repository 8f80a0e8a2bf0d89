"""The control plane: before each step every rank learns every attention rank's RankStep report,
so every rank holds the same vector and computes the same StepPlan. The same round carries
shutdown: a rank that sets the flag stops every rank at the same step.

Two implementations, one interface (`exchange`, `close`): `ControlPlane`, an all-gather over a
CPU (gloo) group, which works across hosts; and `SharedMemoryControl` (control_shm.py), a board in
shared memory for worlds on one host, several times cheaper per round. `open_control_plane` picks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from afdserve.afd.step.control_shm import SharedMemoryControl, shared_memory_supported
from afdserve.engine.control_round import FIELDS, ControlRound, decode, encode
from afdserve.layout.plan import RankStep
from afdserve.layout.topology import Topology


class ControlPlane:
    def __init__(self, topology: Topology, group: dist.ProcessGroup) -> None:
        self.topology, self.group = topology, group
        self._mine = torch.zeros(FIELDS, dtype=torch.int64)
        self._all = [torch.zeros(FIELDS, dtype=torch.int64) for _ in range(topology.world_size)]

    def exchange(self, report: RankStep | None, shutdown: bool = False) -> ControlRound:
        """Attention ranks pass their report; FFN ranks pass None."""
        self._mine.copy_(torch.tensor(encode(report, shutdown), dtype=torch.int64))
        dist.all_gather(self._all, self._mine, group=self.group)
        return decode([t.tolist() for t in self._all], self.topology)

    def close(self) -> None:
        pass


def open_control_plane(
    choice: str,
    topology: Topology,
    group: dist.ProcessGroup,
    rank: int,
    timeout_s: float,
    one_host: bool,
) -> ControlPlane | SharedMemoryControl:
    """Every rank of a world calls this at start-up with the same arguments (`one_host`: the
    built-in launcher spawned the world, so every rank runs on this host); "auto" takes shared
    memory there when this host supports it, and gloo otherwise (torchrun, several hosts)."""
    if choice == "shm" or (choice == "auto" and one_host and shared_memory_supported()):
        return SharedMemoryControl(topology, group, rank, timeout_s)
    return ControlPlane(topology, group)
