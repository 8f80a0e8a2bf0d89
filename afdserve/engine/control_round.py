"""One control round's format: every rank's row of `FIELDS` integers, and what the rows say
(the attention ranks' `RankStep` reports and the shutdown flag). Both control planes
(control.py's gloo all-gather, control_shm.py's board) carry these rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from afdserve.layout.plan import RankStep
from afdserve.layout.topology import Topology

FIELDS = 4  # num_tokens, num_reqs, uniform_decode, shutdown


@dataclass(frozen=True)
class ControlRound:
    reports: tuple[RankStep, ...]
    shutdown: bool


def encode(report: RankStep | None, shutdown: bool) -> tuple[int, int, int, int]:
    """One rank's row; FFN ranks (no report) send zeros."""
    if report is None:
        return 0, 0, 0, int(shutdown)
    return report.num_tokens, report.num_reqs, int(report.uniform_decode), int(shutdown)


def decode(rows: list[list[int]], topology: Topology) -> ControlRound:
    """Every rank's row, in rank order -> the attention ranks' reports and the shutdown flag."""
    reports = tuple(
        RankStep(rows[r][0], rows[r][1], bool(rows[r][2])) for r in range(topology.attention_ranks)
    )
    return ControlRound(reports, any(row[3] for row in rows))


class Control(Protocol):
    def exchange(self, report: RankStep | None, shutdown: bool = False) -> ControlRound: ...


class LocalControl:
    """One process and one attention rank: its report is the whole world's."""

    def exchange(self, report: RankStep | None, shutdown: bool = False) -> ControlRound:
        return ControlRound((report,) if report is not None else (), shutdown)


class FixedControl:
    """Every step the same reports (the decode benchmark's FFN rank knows them in advance)."""

    def __init__(self, reports: tuple[RankStep, ...]) -> None:
        self.reports = reports

    def exchange(self, report: RankStep | None, shutdown: bool = False) -> ControlRound:
        return ControlRound(self.reports, shutdown)
