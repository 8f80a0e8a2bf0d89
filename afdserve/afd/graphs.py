"""Graph policy bookkeeping shared by every rank: the graph table, the per-step decision log, and
lockstep warm-up. The decisions themselves come from the StepPlan only.

On CPU there are no CUDA graphs: a `capture` or `replay` step runs eagerly with exactly the padded
layout the graph would have, and the decision is recorded, so the policy is tested without a GPU.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import TYPE_CHECKING

from afdserve.afd.plan import GraphTable, StepPlan, capture_reports, plan_step
from afdserve.afd.topology import Topology

if TYPE_CHECKING:
    from afdserve.engine.engine_core import EngineCore, RequestOutput


class StepRecorder:
    """One rank's view: the graph table all ranks keep identical, and its step log."""

    def __init__(
        self,
        role: str,
        rank: int,
        graph_mode: str = "none",
        sizes: tuple[int, ...] = (),
        log_path: str | None = None,
        keep_records: bool = False,
        ubatches: int = 1,
    ) -> None:
        self.role, self.rank, self.ubatches = role, rank, ubatches
        self.table = GraphTable(mode=graph_mode, sizes=tuple(sizes))
        self.step = 0
        self.keep_records = keep_records or log_path is not None
        self.records: list[dict] = []
        self.mode_counts: Counter[str] = Counter()
        self._log = open(log_path, "a") if log_path else None  # noqa: SIM115

    def plan(self, reports, topology: Topology) -> StepPlan:
        return plan_step(reports, topology, self.table, self.ubatches)

    def record(self, plan: StepPlan, ranks: tuple[int, ...] | None = None) -> None:
        """Log this rank's line (or the given ranks' lines) and mark new captures on every rank.
        Rounds in which no rank has work are counted but not logged: an idle world polls often."""
        if not plan.has_work:
            self.step += 1
            return
        mine = [r for r in plan.log_records(self.step) if r["rank"] in (ranks or (self.rank,))]
        for rec in mine:
            self.mode_counts[f"{rec['role']}:{rec['mode']}"] += 1
            if self.keep_records:
                self.records.append(rec)
            if self._log is not None:
                self._log.write(json.dumps(rec) + "\n")
                self._log.flush()
        self.table = self.table.with_captured(plan.capture_keys)
        self.step += 1

    def single_process_step(self, core: EngineCore, topology: Topology, boundary
                            ) -> list[RequestOutput]:
        """One step of a one-process engine: colocated (1A0F) or in-process AFD (1A1F)."""
        out, report = core.schedule()
        if out.is_empty:
            return []
        return self._run_single(core, topology, boundary, out, [report])

    def warmup_single_process(self, core: EngineCore, topology: Topology, boundary) -> None:
        """Capture every size, largest first (so smaller graphs can share its memory pool)."""
        from afdserve.engine.scheduler import SchedulerOutput

        for size in sorted(self.table.sizes, reverse=True):
            empty = SchedulerOutput([], [])
            self._run_single(core, topology, boundary, empty, capture_reports(size, topology))

    def _run_single(self, core, topology, boundary, out, reports) -> list[RequestOutput]:
        plan = self.plan(reports, topology)
        mine = plan.attention[0]
        if hasattr(boundary, "begin_step"):
            boundary.begin_step(mine, self.step)
        results = core.execute(out, mine, boundary)
        self.record(plan, ranks=tuple(range(topology.world_size)))
        return results

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
