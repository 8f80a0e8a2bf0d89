"""The FFN side's step loop: the control plane's reports -> `plan_step` -> the FFN step runner ->
the recorder, the counterpart of engine/step_loop.py's AttentionDriver."""

from __future__ import annotations

import time

from afdserve.afd.dataplane.ffn import FFNStepRunner
from afdserve.engine.control_round import Control
from afdserve.engine.step_loop import StepMeter, StepResult, log_captures
from afdserve.engine.step_recorder import StepRecorder
from afdserve.layout.plan import RankStep, warmup_reports
from afdserve.layout.topology import Topology


class FFNDriver:
    def __init__(
        self,
        runner: FFNStepRunner,
        recorder: StepRecorder,
        control: Control,
        topology: Topology,
        rank: int,
    ) -> None:
        self.runner, self.recorder, self.control = runner, recorder, control
        self.topology, self.rank = topology, rank
        self.meter = StepMeter()

    def warmup(self) -> None:
        start = time.perf_counter()
        for reports in warmup_reports(self.recorder.table, self.topology):
            self._run(reports)
        self.meter = StepMeter()
        log_captures(self.rank, start, self.runner.tally.line())

    def step(self) -> StepResult:
        round_ = self.control.exchange(None)
        if round_.shutdown:
            return StepResult([], False, shutdown=True)
        return self._run(round_.reports)

    def _run(self, reports: tuple[RankStep, ...]) -> StepResult:
        plan = self.recorder.plan(reports, self.topology)
        mine = plan.for_rank(self.rank)
        start = time.perf_counter()
        self.runner.run(mine, self.recorder.step)
        if mine.mode != "idle":
            self.meter.forward_s += time.perf_counter() - start
            self.meter.scheduled_tokens += mine.real_rows
        self.recorder.record(plan)
        return StepResult([], plan.has_work)
