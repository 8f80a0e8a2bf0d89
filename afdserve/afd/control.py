"""The control plane: each step every rank all-gathers the attention ranks' RankStep reports over a
CPU (gloo) group, so every rank holds the same vector and computes the same StepPlan. The same
all-gather carries shutdown: a rank that sets the flag stops every rank at the same step."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from afdserve.layout.plan import RankStep
from afdserve.layout.topology import Topology

_FIELDS = 4  # num_tokens, num_reqs, uniform_decode, shutdown


@dataclass(frozen=True)
class ControlRound:
    reports: tuple[RankStep, ...]
    shutdown: bool


class ControlPlane:
    def __init__(self, topology: Topology, group: dist.ProcessGroup) -> None:
        self.topology, self.group = topology, group
        self._mine = torch.zeros(_FIELDS, dtype=torch.int64)
        self._all = [torch.zeros(_FIELDS, dtype=torch.int64) for _ in range(topology.world_size)]

    def exchange(self, report: RankStep | None, shutdown: bool = False) -> ControlRound:
        """Attention ranks pass their report; FFN ranks pass None."""
        mine = self._mine
        mine.zero_()
        if report is not None:
            mine[0], mine[1], mine[2] = (
                report.num_tokens,
                report.num_reqs,
                int(report.uniform_decode),
            )
        mine[3] = int(shutdown)
        dist.all_gather(self._all, mine, group=self.group)
        rows = [t.tolist() for t in self._all]
        reports = tuple(
            RankStep(rows[r][0], rows[r][1], bool(rows[r][2]))
            for r in range(self.topology.attention_ranks)
        )
        return ControlRound(reports, any(row[3] for row in rows))
