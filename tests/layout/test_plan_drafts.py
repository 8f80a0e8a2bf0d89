"""Rules 9 and 10 of plan_step: the draft passes (MTP) ride in every rank plan, each a one-ubatch
step over rows that bound the pass, graphed where its shape allows with keys of its own kind, and
they leave the main step's plan as it was."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings

from afdserve.layout.plan import DRAFT_TAGS, GraphTable, RankStep, plan_step
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
            if mine.mode == "idle":
                assert draft.mode == "idle"
            assert draft.real_rows == bound(reports[rank], j) <= draft.padded_rows
            if draft.mode == "eager":
                assert draft.padded_rows == draft.real_rows
            elif draft.mode != "idle":  # a graph pass pads to a capture size, under its tag
                assert draft.padded_rows in table.sizes and table.mode != "none"
                assert draft.key[-1] == DRAFT_TAGS[min(j, 1)]
            assert len(draft.tile_rows) == 1 and draft.drafts == ()
            if draft.ffn_rank is not None:
                assert draft.tile_rows[0] >= draft.padded_rows
                theirs = plan.for_rank(draft.ffn_rank).drafts[j]
                assert draft.ffn_rows(0) in [(lo, hi) for _, lo, hi in theirs.peer_rows(0)]
                assert (theirs.mode == "eager") == (draft.mode == "eager")
    for mine in plan.ffn:
        for j, draft in enumerate(mine.drafts):
            if mine.mode == "idle":
                assert draft.mode == "idle"
            assert draft.real_rows == sum(bound(reports[p], j) for p in draft.peers)
            if draft.group:
                assert draft.group_rows[0] >= draft.receive_rows[0]
    # Every key a pass captures is recorded, and a pass never replays a key nothing captured.
    captured = table.captured | plan.capture_keys
    for mine in plan.attention + plan.ffn:
        for draft in mine.drafts:
            assert draft.mode != "replay" or draft.key in captured


def test_draft_keys_are_their_own_and_a_later_pass_replays_its_capture() -> None:
    """Two decoding requests with k = 2 under full_decode_only: pass 0 (6 rows) and pass 1 (2
    rows) both pad to 8; each kind captures its own key, none a main step's, and the next
    step replays them all."""
    topology = Topology.parse("1A1F")
    table = GraphTable("full_decode_only", (8,))
    reports = [RankStep(6, 2, True)]
    plan = plan_step(reports, topology, table, 1, 3)
    mine = plan.attention[0]
    assert [d.mode for d in mine.drafts] == ["capture", "capture", "replay"]
    assert [d.key[-1] for d in mine.drafts] == [DRAFT_TAGS[0], DRAFT_TAGS[1], DRAFT_TAGS[1]]
    assert mine.key not in {d.key for d in mine.drafts}
    assert [d.mode for d in plan.ffn[0].drafts] == ["capture", "capture", "replay"]
    again = plan_step(reports, topology, table.with_captured(plan.capture_keys), 1, 3)
    for rank_plan in again.attention + again.ffn:
        assert [d.mode for d in rank_plan.drafts] == ["replay"] * 3
    # A prefill step's pass 0 runs eagerly; its chained passes are decode-shaped still.
    mixed = plan_step([RankStep(6, 2, False)], topology, table, 1, 2)
    assert [d.mode for d in mixed.attention[0].drafts] == ["eager", "capture"]


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
