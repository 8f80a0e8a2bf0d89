"""The step drivers: one per role, and the only loops that plan, execute and record a step.

Attention side (also colocated and in-process AFD): the work source schedules and reports a
`RankStep` -> the control plane hands every rank the same reports -> `plan_step` -> the source
executes its rank's plan -> the recorder logs the decision and marks new captures.
FFN side: the control plane's reports -> `plan_step` -> the FFN step runner -> the recorder.

The engine (`EngineCore`), the rank workers, the one-process client and the decode benchmark all
step through these, and warm up through the same `warmup_reports` order.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from afdserve.engine.control_round import Control
from afdserve.engine.cuda_graphs import PlannedForward
from afdserve.engine.step_recorder import StepRecorder
from afdserve.layout.plan import AttentionRankPlan, RankStep, warmup_reports
from afdserve.layout.topology import Topology

log = logging.getLogger(__name__)


class WorkSource(Protocol):
    """What an attention driver steps: the engine, or the benchmark's fixed decode batch."""

    def schedule(self) -> tuple[Any, RankStep]: ...

    def execute(
        self, work: Any, plan: AttentionRankPlan, forward: PlannedForward, step: int
    ) -> Any: ...

    def idle_work(self) -> Any: ...


@dataclass(frozen=True)
class StepResult:
    outputs: Any  # what the source's execute returned ([] when this rank had nothing to run)
    has_work: bool  # some rank of the world had work
    shutdown: bool = False


@dataclass
class StepMeter:
    """What one rank's steps did, for /metrics: the tokens of each step not yet reported (the
    worker drains them; attention ranks), and cumulative figures (an FFN rank's forward_s is
    its FFN half's step, waits for the tiles included; its scheduled_tokens the real rows it
    received)."""

    step_tokens: list[int] = field(default_factory=list)
    scheduled_tokens: int = 0
    forward_s: float = 0.0  # wall seconds in execute: the forward, its waits and sampling
    tile_rows: int = 0  # rows sent per layer, every ubatch together (the FFN replies as many)

    def drain(self) -> tuple[int, ...]:
        tokens, self.step_tokens = tuple(self.step_tokens), []
        return tokens


def log_captures(rank: int, start: float, line: str | None) -> None:
    """The warm-up's line of a rank that captured CUDA graphs: what they cost, by kind."""
    if line is not None:
        seconds = time.perf_counter() - start
        log.info("rank %d warmed up in %.1f s and %s", rank, seconds, line)


class AttentionDriver:
    def __init__(
        self,
        source: WorkSource,
        forward: PlannedForward,
        recorder: StepRecorder,
        control: Control,
        topology: Topology,
        rank: int,
        log_ranks: tuple[int, ...] | None = None,
    ) -> None:
        self.source, self.forward, self.recorder = source, forward, recorder
        self.control, self.topology, self.rank = control, topology, rank
        self.log_ranks = log_ranks  # a one-process engine logs the FFN half's line too
        self.meter = StepMeter()

    def warmup(self) -> None:
        start = time.perf_counter()
        for reports in warmup_reports(self.recorder.table, self.topology):
            self._run(self.source.idle_work(), reports)
        self.meter = StepMeter()  # warm-up steps are no traffic
        graphs = self.forward.graphs
        log_captures(self.rank, start, graphs.tally.line() if graphs is not None else None)

    def step(self, shutdown: bool = False) -> StepResult:
        work, report = self.source.schedule()
        round_ = self.control.exchange(report, shutdown)
        if round_.shutdown:
            return StepResult([], False, shutdown=True)
        return self._run(work, round_.reports)

    def _run(self, work: Any, reports: tuple[RankStep, ...]) -> StepResult:
        plan = self.recorder.plan(reports, self.topology)
        mine = plan.attention[self.rank]
        step = self.recorder.step
        outputs = []
        if mine.mode != "idle":
            start = time.perf_counter()
            outputs = self.source.execute(work, mine, self.forward, step)
            meter = self.meter
            meter.forward_s += time.perf_counter() - start
            meter.scheduled_tokens += mine.real_rows
            meter.tile_rows += sum(mine.tile_rows)
            if mine.real_rows:
                meter.step_tokens.append(mine.real_rows)
        self.recorder.record(plan, self.log_ranks)
        return StepResult(outputs, plan.has_work)
