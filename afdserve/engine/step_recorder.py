"""One rank's record of the steps it took part in: the graph table (which keys every rank has
captured so far, identical on all ranks) and the per-step decision log (`--log-step-plan`).
The decisions themselves come from the StepPlan only.

On CPU there are no CUDA graphs: a `capture` or `replay` step runs eagerly with exactly the padded
layout the graph would have, and the decision is recorded, so the policy is tested without a GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections import Counter

from afdserve.layout.plan import GraphTable, StepPlan, plan_step
from afdserve.layout.topology import Topology


class StepRecorder:
    """One rank's view: the graph table all ranks keep identical, and its step log."""

    def __init__(
        self,
        rank: int,
        graph_mode: str = "none",
        sizes: tuple[int, ...] = (),
        log_path: str | None = None,
        keep_records: bool = False,
        ubatches: int = 1,
        draft_passes: int = 0,
    ) -> None:
        self.rank, self.ubatches, self.draft_passes = rank, ubatches, draft_passes
        self.table = GraphTable(mode=graph_mode, sizes=tuple(sizes))
        self.step = 0
        self._planned_at = 0.0  # the wall clock of the last plan, for the log's lines
        self.keep_records = keep_records or log_path is not None
        self.records: list[dict] = []
        self.mode_counts: Counter[str] = Counter()
        self._log = open(log_path, "a") if log_path else None  # noqa: SIM115

    def plan(self, reports, topology: Topology) -> StepPlan:
        self._planned_at = time.time()
        return plan_step(reports, topology, self.table, self.ubatches, self.draft_passes)

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
                # Wall clocks: when the step was planned and when this rank had run it, host
                # work included (tools/step_times.py reads a served engine's steps from them).
                times = {"start": round(self._planned_at, 6), "end": round(time.time(), 6)}
                self._log.write(json.dumps({**rec, **times}) + "\n")
                self._log.flush()
        self.table = self.table.with_captured(plan.capture_keys)
        self.step += 1

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


class StepLogFile:
    """Where the ranks of one engine append their step records (`log_step_plan`). A path the
    caller named is theirs to keep; a temporary one (`log_step_plan=True`) is read into memory
    and removed at `close()`, once every rank has stopped writing."""

    def __init__(self, log_step_plan: bool | str) -> None:
        self.owned = log_step_plan is True
        self._closed: list[dict] | None = None
        if self.owned:
            fd, self.path = tempfile.mkstemp(prefix="afdserve-step-plan-", suffix=".jsonl")
            os.close(fd)
        else:
            self.path = str(log_step_plan) if log_step_plan else None

    def read(self) -> list[dict]:
        if self._closed is not None:
            return list(self._closed)
        if self.path is None:
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def close(self) -> None:
        if self.owned and self._closed is None:
            self._closed = self.read()
            with contextlib.suppress(OSError):
                os.remove(self.path)
