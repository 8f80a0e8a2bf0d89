"""The plan of an expert-parallel FFN group (plan.py rules 7-8) and expert placement: every FFN
rank of the group contributes the same planned rows to the group's exchange, which holds every
received row; the group shares one run mode with every attention rank; keys spell out the
group's rows."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afdserve.layout.experts import (
    check_placement_shape,
    contiguous_placement,
    resolve_placement,
)
from afdserve.layout.plan import GraphTable, RankStep, plan_step
from afdserve.layout.topology import Topology

from .test_plan import Scenario, scenarios, warmed_table

PROPERTY = settings(max_examples=400, deadline=None, database=None)

expert_topologies = st.sampled_from(
    [Topology(a, f, expert_parallel=True) for a in range(1, 9) for f in range(1, 9)]
)


def expert_scenarios(steps: st.SearchStrategy[int] = st.just(1)) -> st.SearchStrategy[Scenario]:
    return scenarios(steps, topology_strategy=expert_topologies)


@PROPERTY
@given(expert_scenarios())
def test_group_rows_hold_every_received_row(scenario: Scenario) -> None:
    topology, table, ubatches, steps = scenario
    plan = plan_step(steps[0], topology, table, ubatches)
    a, f_count = topology.attention_ranks, topology.ffn_ranks
    assert [p.rank for p in plan.ffn] == list(topology.ffn_group)
    for rank_plan in plan.attention:
        assert rank_plan.ffn_rank == a + rank_plan.rank % f_count
        home = plan.ffn[rank_plan.ffn_rank - a]
        assert rank_plan.rank in home.peers
        # Rows written = rows read on the point-to-point part, as without expert parallelism.
        assert rank_plan.tile_rows == home.tile_rows
        assert all(t >= r for t, r in zip(rank_plan.tile_rows, rank_plan.ubatch_rows))
    group_rows = {p.group_rows for p in plan.ffn}
    assert len(group_rows) == 1, "every member contributes the same rows to the exchange"
    (rows,) = group_rows
    for ffn_plan in plan.ffn:
        assert ffn_plan.group == topology.ffn_group
        assert ffn_plan.peers == tuple(r for r in range(a) if r % f_count == ffn_plan.rank - a)
        assert ffn_plan.receive_rows == tuple(len(ffn_plan.peers) * t for t in ffn_plan.tile_rows)
        assert ffn_plan.exchange_rows == rows
    # The exchange's capacity is the largest receive: an upper bound by construction, and tight.
    assert rows == tuple(max(p.receive_rows[u] for p in plan.ffn) for u in range(ubatches))
    assert sum(rows) * f_count >= sum(sum(p.receive_rows) for p in plan.ffn)
    assert sum(p.real_rows for p in plan.ffn) == sum(r.num_tokens for r in steps[0])


@PROPERTY
@given(expert_scenarios())
def test_the_world_shares_one_run_mode(scenario: Scenario) -> None:
    """FFN ranks that exchange rows share the most conservative mode, and replay only when every
    attention rank replays (an eager prefill anywhere makes the whole group eager)."""
    topology, table, ubatches, steps = scenario
    reports = steps[0]
    plan = plan_step(reports, topology, table, ubatches)
    modes = {p.mode for p in plan.attention + plan.ffn}
    assert len(modes) == 1
    (mode,) = modes
    working = [r for r in reports if r.num_tokens > 0]
    if not working:
        assert mode == "idle"
        assert all(not any(p.exchange_rows) and p.key is None for p in plan.ffn)
        return
    largest = max(r.num_tokens for r in working)
    graph_allowed = largest <= table.largest and (
        table.mode == "full"
        or table.mode == "full_decode_only"
        and all(r.uniform_decode for r in working)
    )
    assert (mode in ("capture", "replay")) == graph_allowed
    keys = [p.key for p in plan.attention + plan.ffn]
    assert (mode == "replay") == (graph_allowed and all(k in table.captured for k in keys))
    # A working world exchanges rows in every ubatch that has rows anywhere.
    assert all(any(p.exchange_rows) for p in plan.ffn)


@PROPERTY
@given(expert_scenarios(st.integers(1, 5)))
def test_expert_keys_never_alias_layouts(scenario: Scenario) -> None:
    topology, table, ubatches, steps = scenario
    layouts: dict[tuple, tuple] = {}
    for reports in steps:
        plan = plan_step(reports, topology, table, ubatches)
        for ffn_plan in plan.ffn:
            peer_rows = tuple(plan.attention[p].ubatch_rows for p in ffn_plan.peers)
            layout = (ffn_plan.rank, peer_rows, ffn_plan.tile_rows, ffn_plan.group_rows)
            if ffn_plan.key is not None:
                assert layouts.setdefault(ffn_plan.key, layout) == layout
        again = plan_step(reports, topology, table, ubatches)
        assert again == plan and again.log_records(3) == plan.log_records(3)
        table = table.with_captured(plan.capture_keys)


def test_one_attention_rank_two_ffn_ranks() -> None:
    topology = Topology.parse("1A2F", expert_parallel=True)
    plan = plan_step([RankStep(5, 2, False)], topology, GraphTable(), ubatches=2)
    first, second = plan.ffn
    assert (first.peers, first.receive_rows, first.group_rows) == ((0,), (3, 2), (3, 2))
    assert (second.peers, second.receive_rows, second.group_rows) == ((), (0, 0), (3, 2))
    assert second.mode == "eager" and second.key == ("ffn", 2, (), (3, 2), (3, 2))
    record = plan.log_records(0)[-1]
    assert record["group_rows"] == [3, 2] and record["peers"] == []


def test_an_eager_rank_anywhere_keeps_the_group_eager() -> None:
    topology = Topology.parse("2A2F", expert_parallel=True)
    table = warmed_table(topology, "full_decode_only", (1, 4, 8), (1, 4, 8))
    decoding = plan_step([RankStep(4, 4, True), RankStep(3, 3, True)], topology, table)
    assert {p.mode for p in decoding.attention + decoding.ffn} == {"replay"}
    # Rank 1 prefills: its own FFN rank would be eager anyway; FFN rank 2 (peer: rank 0, a
    # decode with a captured layout) must not replay, since it exchanges rows with FFN rank 3.
    mixed = plan_step([RankStep(4, 4, True), RankStep(3, 1, False)], topology, table)
    assert {p.mode for p in mixed.attention + mixed.ffn} == {"eager"}
    assert [p.group_rows for p in mixed.ffn] == [(4,), (4,)]


def test_contiguous_placement_and_user_tables() -> None:
    assert contiguous_placement(8, 3) == ((0, 1, 2), (3, 4, 5), (6, 7))
    assert contiguous_placement(2, 4) == ((0,), (1,), (), ())
    assert resolve_placement(None, 4, 2) == ((0, 1), (2, 3))
    assert resolve_placement([[3, 0], [2, 1]], 4, 2) == ((0, 3), (1, 2))
    with pytest.raises(ValueError, match=r"one list of expert ids per FFN rank \(2 lists"):
        check_placement_shape([[0, 1, 2, 3]], 2)
    with pytest.raises(ValueError, match=r"expert_placement\[1\]=\[-1\].*integers >= 0"):
        check_placement_shape([[0], [-1]], 2)
    with pytest.raises(ValueError, match=r"more than once.*\{2: \[0, 1\]\}"):
        check_placement_shape([[0, 2], [1, 2]], 2)
    with pytest.raises(ValueError, match=r"held by no FFN rank: \[3\]"):
        resolve_placement([[0, 1], [2]], 4, 2)
    with pytest.raises(ValueError, match=r"outside \[0, 4\): \[7\]"):
        resolve_placement([[0, 1, 3], [2, 7]], 4, 2)
