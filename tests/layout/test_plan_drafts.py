"""Rule 9 of plan_step: the draft passes (MTP) ride in every rank plan, each a one-ubatch eager
step over rows that bound the pass, and they leave the main step's plan as it was."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings

from afdserve.layout.plan import GraphTable, RankStep, plan_step
from afdserve.layout.topology import Topology

from .test_plan import Scenario, scenarios

DRAFTS = settings(max_examples=300, deadline=None, database=None)


def bound(report: RankStep, draft: int) -> int:
    """Pass 0: the rows the step may keep; later passes: one chained draft a request."""
    return report.num_tokens if draft == 0 else report.num_reqs


@DRAFTS
@given(scenarios())
def test_draft_passes_bound_their_rows_and_keep_the_main_plan(scenario: Scenario) -> None:
    topology, table, ubatches, steps = scenario
    reports = steps[0]
    plain = plan_step(reports, topology, table, ubatches)
    plan = plan_step(reports, topology, table, ubatches, draft_passes=2)
    for mine, theirs in zip(plan.attention + plan.ffn, plain.attention + plain.ffn, strict=True):
        assert dataclasses.replace(mine, drafts=()) == theirs
        assert len(mine.drafts) == 2
    for rank, mine in enumerate(plan.attention):
        for j, draft in enumerate(mine.drafts):
            assert draft.mode == ("idle" if mine.mode == "idle" else "eager")
            assert draft.real_rows == draft.padded_rows == bound(reports[rank], j)
            assert len(draft.tile_rows) == 1 and draft.drafts == ()
            if draft.ffn_rank is not None:
                assert draft.tile_rows[0] >= draft.padded_rows
                theirs = plan.for_rank(draft.ffn_rank).drafts[j]
                assert draft.ffn_rows(0) in [(lo, hi) for _, lo, hi in theirs.peer_rows(0)]
    for mine in plan.ffn:
        for j, draft in enumerate(mine.drafts):
            assert draft.mode == ("idle" if mine.mode == "idle" else "eager")
            assert draft.real_rows == sum(bound(reports[p], j) for p in draft.peers)
            if draft.group:
                assert draft.group_rows[0] >= draft.receive_rows[0]


def test_two_to_one_mixed_step() -> None:
    """A prefill chunk of 7 beside an idle peer: pass 0 tiles 7 rows, pass 1 one."""
    topology = Topology.parse("2A1F")
    plan = plan_step([RankStep(7, 1, False), RankStep(0, 0, False)], topology, GraphTable(), 1, 2)
    ffn = plan.ffn[0]
    assert [d.tile_rows for d in ffn.drafts] == [(7,), (1,)]
    assert [d.receive_rows for d in ffn.drafts] == [(14,), (2,)]
    idle_peer = plan.attention[1]
    assert [(d.real_rows, d.tile_rows, d.mode) for d in idle_peer.drafts] == [
        (0, (7,), "eager"),
        (0, (1,), "eager"),
    ]


def test_draft_passes_validate() -> None:
    with pytest.raises(ValueError, match="draft_passes must be an int >= 0"):
        plan_step([RankStep(1, 1, True)], Topology.parse("colocated"), GraphTable(), 1, -1)
