from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afdserve.layout.plan import (
    GRAPH_MODES,
    AttentionRankPlan,
    FFNRankPlan,
    GraphTable,
    RankStep,
    StepPlan,
    capture_reports,
    plan_step,
    split_rows,
)
from afdserve.layout.topology import Topology

PROPERTY = settings(max_examples=2000, deadline=None, database=None)

IDLE = RankStep(0, 0, False)


def decode(n: int) -> RankStep:
    return RankStep(n, n, True)


def warmed_table(
    topology: Topology, mode: str, sizes: tuple[int, ...], warm: tuple[int, ...], ubatches: int = 1
) -> GraphTable:
    """The table after a warm-up that ran capture steps for the sizes in `warm`, of every kind
    the mode captures (as `warmup_reports` does)."""
    table = GraphTable(mode, sizes)
    kinds = ("mixed", "decode") if mode == "full" else ("decode",)
    for size, kind in itertools.product(warm, kinds):
        reports = capture_reports(size, topology, kind)
        table = table.with_captured(plan_step(reports, topology, table, ubatches).capture_keys)
    return table


# ---------------------------------------------------------------- strategies
# Generation dominates these tests' runtime, so every value is one plain draw from a strategy
# built once: up to 16 ranks x 6 steps of reports per example, 2000 examples per property.

# A in 1..16 with F in 1..8 and A >= F, or F = 0 (colocated; data parallel when A > 1).
topologies = st.sampled_from(
    [Topology(a, f) for a in range(1, 17) for f in range(min(a, 8) + 1)]
    + [Topology(a, 0) for a in range(1, 17)]  # weigh colocated up a little
)
codes = st.integers(0, 2**13 - 1)
rank_codes = st.integers(0, 12 * 2**13 - 1)
ubatch_counts = st.integers(1, 4)
graph_modes = st.sampled_from(GRAPH_MODES)
ladder_lengths = st.integers(0, 6)
forget_strides = st.sampled_from((0, 0, 2, 3, 7))


def _count(code: int) -> int:
    # Even codes give small counts (0..12), so that groups fit the capture ladder and keys
    # repeat across steps; odd codes give counts up to 2048.
    return (code // 2) % 13 if code % 2 == 0 else (code // 2) % 2049


def _rank_step(rank_code: int) -> RankStep:
    # Shapes 0-1 idle, 2-6 uniform decode, 7 decode-shaped but not flagged uniform,
    # 8-11 mixed (fewer requests than tokens, never uniform). Hypothesis favours small draws:
    # those mean small counts, of any shape.
    code, shape = divmod(rank_code, 12)
    tokens = _count(code)
    if tokens == 0 or shape <= 1:
        return IDLE
    if shape <= 7:
        return RankStep(tokens, tokens, shape <= 6)
    return RankStep(tokens, max(1, tokens * (shape - 8) // 4), False)


# (topology, graph table, ubatches, one report vector per step)
Scenario = tuple[Topology, GraphTable, int, list[tuple[RankStep, ...]]]


@st.composite
def scenarios(
    draw: st.DrawFn,
    steps: st.SearchStrategy[int] = st.just(1),
    topology_strategy: st.SearchStrategy[Topology] | None = None,
) -> Scenario:
    topology = draw(topologies if topology_strategy is None else topology_strategy)
    ubatches = draw(ubatch_counts)
    mode = draw(graph_modes)
    sizes = tuple(sorted({_count(draw(codes)) or 1 for _ in range(draw(ladder_lengths))}))
    warm = tuple(size for size in sizes if draw(st.booleans()))
    table = warmed_table(topology, mode, sizes, warm, ubatches)
    # Sometimes forget a few captured keys, so that tables also hold part of a group's graphs.
    forget = draw(forget_strides)
    if forget:
        keys = sorted(table.captured, key=repr)
        table = GraphTable(mode, sizes, frozenset(keys) - frozenset(keys[forget - 1 :: forget]))
    reports = [
        tuple(_rank_step(draw(rank_codes)) for _ in range(topology.attention_ranks))
        for _ in range(draw(steps))
    ]
    return topology, table, ubatches, reports


def groups(topology: Topology, plan: StepPlan) -> list[tuple[FFNRankPlan | None, list[int]]]:
    """(FFN plan or None, member attention ranks), derived from the r mod F rule."""
    if topology.colocated:
        return [(None, [rank]) for rank in range(topology.attention_ranks)]
    return [
        (plan.ffn[f], [r for r in range(topology.attention_ranks) if r % topology.ffn_ranks == f])
        for f in range(topology.ffn_ranks)
    ]


# ---------------------------------------------------------------- properties


@PROPERTY
@given(scenarios())
def test_rows_written_equal_rows_read(scenario: Scenario) -> None:
    topology, table, ubatches, steps = scenario
    plan = plan_step(steps[0], topology, table, ubatches)
    assert plan.ubatches == ubatches
    assert len(plan.attention) == topology.attention_ranks
    assert len(plan.ffn) == topology.ffn_ranks
    for report, rank_plan in zip(steps[0], plan.attention, strict=True):
        assert rank_plan.real_rows == report.num_tokens
        assert rank_plan.padded_rows >= rank_plan.real_rows
        assert sum(rank_plan.ubatch_real_rows) == rank_plan.real_rows
        assert sum(rank_plan.ubatch_rows) == rank_plan.padded_rows
        assert all(len(rows) == ubatches for rows in (rank_plan.ubatch_rows, rank_plan.tile_rows))
        assert all(
            real <= rows
            for real, rows in zip(rank_plan.ubatch_real_rows, rank_plan.ubatch_rows, strict=True)
        )
        # Real rows fill the padded batch from the front: only the last partly-real ubatch and
        # the ones after it may hold pad rows.
        partial = [
            u for u in range(ubatches) if rank_plan.ubatch_real_rows[u] < rank_plan.ubatch_rows[u]
        ]
        if partial:
            assert not any(rank_plan.ubatch_real_rows[partial[0] + 1 :])
        if topology.colocated:
            assert rank_plan.ffn_rank is None and not any(rank_plan.tile_rows)
        else:
            assert rank_plan.ffn_rank == topology.ffn_rank_of(rank_plan.rank)
            assert all(
                tile >= rows
                for tile, rows in zip(rank_plan.tile_rows, rank_plan.ubatch_rows, strict=True)
            )
    for ffn_plan, members in groups(topology, plan):
        if ffn_plan is None:
            continue
        assert list(ffn_plan.peers) == members
        assert ffn_plan.rank == topology.attention_ranks + topology.ffn_index(ffn_plan.rank)
        for peer in members:
            assert plan.attention[peer].tile_rows == ffn_plan.tile_rows
            assert plan.attention[peer].ffn_rank == ffn_plan.rank
        assert ffn_plan.receive_rows == tuple(len(members) * t for t in ffn_plan.tile_rows)
        assert ffn_plan.real_rows == sum(plan.attention[p].real_rows for p in members)
        # The tile is as small as the layout allows: the largest peer's ubatch fills it.
        if ffn_plan.mode != "idle":
            assert ffn_plan.tile_rows == tuple(
                max(plan.attention[p].ubatch_rows[u] for p in members) for u in range(ubatches)
            )


@PROPERTY
@given(scenarios())
def test_peers_partition_attention_ranks(scenario: Scenario) -> None:
    topology, table, ubatches, steps = scenario
    plan = plan_step(steps[0], topology, table, ubatches)
    served = [peer for ffn_plan in plan.ffn for peer in ffn_plan.peers]
    if topology.colocated:
        assert served == []
    else:
        assert sorted(served) == list(range(topology.attention_ranks))
    for rank in range(topology.world_size):
        if rank < topology.attention_ranks:
            assert plan.for_rank(rank) is plan.attention[rank]
        else:
            assert plan.for_rank(rank) is plan.ffn[rank - topology.attention_ranks]


@PROPERTY
@given(scenarios(st.integers(1, 6)))
def test_keys_never_alias_layouts(scenario: Scenario) -> None:
    topology, table, ubatches, steps = scenario
    layouts: dict[tuple, tuple] = {}
    for reports in steps:
        plan = plan_step(reports, topology, table, ubatches)
        for rank_plan in plan.attention:
            layout = ("attention", rank_plan.rank, rank_plan.ubatch_rows, rank_plan.tile_rows)
            if rank_plan.key is not None:
                assert layouts.setdefault(rank_plan.key, layout) == layout
        for ffn_plan in plan.ffn:
            peer_rows = tuple(plan.attention[p].ubatch_rows for p in ffn_plan.peers)
            layout = ("ffn", ffn_plan.rank, peer_rows, ffn_plan.tile_rows)
            if ffn_plan.key is not None:
                assert layouts.setdefault(ffn_plan.key, layout) == layout
        table = table.with_captured(plan.capture_keys)


@PROPERTY
@given(scenarios())
def test_paired_replay(scenario: Scenario) -> None:
    topology, table, ubatches, steps = scenario
    reports = steps[0]
    plan = plan_step(reports, topology, table, ubatches)
    for ffn_plan, members in groups(topology, plan):
        member_plans = [plan.attention[r] for r in members]
        modes = {p.mode for p in member_plans} | ({ffn_plan.mode} if ffn_plan else set())
        assert len(modes) == 1, "a group never splits its run mode"
        (mode,) = modes
        working = [reports[r] for r in members if reports[r].num_tokens > 0]
        if not working:
            assert mode == "idle"
            continue
        largest_real = max(report.num_tokens for report in working)
        graph_allowed = largest_real <= table.largest and (
            table.mode == "full"
            or table.mode == "full_decode_only"
            and all(r.uniform_decode for r in working)
        )
        assert (mode in ("capture", "replay")) == graph_allowed
        keys = [p.key for p in member_plans] + ([ffn_plan.key] if ffn_plan else [])
        if mode == "replay":
            assert all(key in table.captured for key in keys)
        if mode == "capture":
            assert not all(key in table.captured for key in keys)
        if graph_allowed:
            size = min(s for s in table.sizes if s >= largest_real)
            assert all(p.padded_rows == size for p in member_plans)
        else:
            assert all(p.padded_rows == p.real_rows for p in member_plans)


@PROPERTY
@given(
    topologies, ubatch_counts, st.sampled_from((1, 3, 8, 16)), st.lists(st.booleans(), max_size=16)
)
def test_eager_attention_never_meets_an_ffn_replay(
    topology: Topology, ubatches: int, size: int, prefilling: list[bool]
) -> None:
    """The field report's hazard: a captured FFN layout met by an eager attention step."""
    table = warmed_table(topology, "full_decode_only", (1, 3, 8, 16), (1, 3, 8, 16), ubatches)
    # Every rank computes exactly `size` rows, so every group's layout was captured; ranks
    # marked as prefilling (chunked prefill of `size` tokens for one request) are not decoding.
    marked = [i < len(prefilling) and prefilling[i] for i in range(topology.attention_ranks)]
    reports = [RankStep(size, 1, False) if m else decode(size) for m in marked]
    plan = plan_step(reports, topology, table, ubatches)
    for ffn_plan, members in groups(topology, plan):
        decoding = all(reports[r].uniform_decode for r in members)
        expected = "replay" if decoding else "eager"
        assert [plan.attention[r].mode for r in members] == [expected] * len(members)
        if ffn_plan is not None:
            assert ffn_plan.key in table.captured
            assert ffn_plan.mode == expected


@PROPERTY
@given(scenarios(st.integers(1, 4)))
def test_ranks_replay_only_graphs_they_captured(scenario: Scenario) -> None:
    """Feed each step's captures back into the table, as the engine does."""
    topology, table, ubatches, steps = scenario
    held: dict[int, set[tuple]] = {rank: set() for rank in range(topology.world_size)}
    table = GraphTable(table.mode, table.sizes)  # cold: every capture happens in this test
    for reports in steps + steps[::-1]:
        plan = plan_step(reports, topology, table, ubatches)
        for rank_plan in plan.attention + plan.ffn:
            if rank_plan.mode == "replay":
                assert rank_plan.key in held[rank_plan.rank]
            if rank_plan.mode == "capture":
                held[rank_plan.rank].add(rank_plan.key)
        table = table.with_captured(plan.capture_keys)
        # Repeating a step that captured now replays those same graphs.
        again = plan_step(reports, topology, table, ubatches)
        pairs = zip(plan.attention + plan.ffn, again.attention + again.ffn, strict=True)
        for before, after in pairs:
            assert after.mode == ("replay" if before.mode == "capture" else before.mode)
            assert after.key == before.key


@PROPERTY
@given(scenarios())
def test_plan_is_deterministic(scenario: Scenario) -> None:
    topology, table, ubatches, steps = scenario
    plan = plan_step(steps[0], topology, table, ubatches)
    copied_reports = [RankStep(r.num_tokens, r.num_reqs, r.uniform_decode) for r in steps[0]]
    copied_table = GraphTable(table.mode, list(table.sizes), set(table.captured))
    again = plan_step(copied_reports, Topology.parse(str(topology)), copied_table, ubatches)
    assert again == plan
    assert again.log_records(7) == plan.log_records(7)
    assert hash(again) == hash(plan)


@PROPERTY
@given(scenarios())
def test_idle_groups_exchange_nothing(scenario: Scenario) -> None:
    topology, table, ubatches, steps = scenario
    plan = plan_step(steps[0], topology, table, ubatches)
    assert plan.has_work == any(report.num_tokens for report in steps[0])
    for ffn_plan, members in groups(topology, plan):
        member_plans = [plan.attention[r] for r in members]
        idle = all(p.real_rows == 0 for p in member_plans)
        for p in member_plans + ([ffn_plan] if ffn_plan else []):
            assert (p.mode == "idle") == idle
            assert (p.key is None) == idle
            if idle:
                assert not any(p.tile_rows)
        if idle:
            assert all(p.padded_rows == 0 and not any(p.ubatch_rows) for p in member_plans)
            assert ffn_plan is None or not any(ffn_plan.receive_rows)


@settings(max_examples=500, deadline=None, database=None)
@given(st.integers(0, 5000), st.integers(1, 8))
def test_split_rows_is_contiguous_and_near_equal(rows: int, ubatches: int) -> None:
    chunks = split_rows(rows, ubatches)
    assert len(chunks) == ubatches and sum(chunks) == rows
    assert list(chunks) == sorted(chunks, reverse=True)
    assert max(chunks) - min(chunks) <= 1


# ---------------------------------------------------------------- field reports


@pytest.fixture
def two_to_one() -> tuple[Topology, GraphTable]:
    topology = Topology.parse("2A1F")
    return topology, warmed_table(topology, "full_decode_only", (1, 2, 4, 8), warm=(4, 8))


def test_decode_four_plus_four_replays(two_to_one) -> None:
    topology, table = two_to_one
    plan = plan_step([decode(4), decode(4)], topology, table)
    assert [p.mode for p in plan.attention + plan.ffn] == ["replay"] * 3
    assert plan.ffn[0].key == ("ffn", 2, ((4,), (4,)), (4,))
    assert plan.ffn[0].receive_rows == (8,)


def test_chunked_prefill_seven_plus_one_runs_ffn_eagerly(two_to_one) -> None:
    topology, table = two_to_one
    plan = plan_step([RankStep(7, 1, False), decode(1)], topology, table)
    assert [p.mode for p in plan.attention + plan.ffn] == ["eager"] * 3
    assert plan.ffn[0].key == ("ffn", 2, ((7,), (1,)), (7,))
    assert plan.ffn[0].key not in table.captured
    # Rank 1 sends 7 rows (1 real, 6 pad) so the FFN reads exactly what both peers wrote.
    assert [p.tile_rows for p in plan.attention] == [(7,), (7,)]
    assert plan.ffn[0].receive_rows == (14,)


def test_eager_step_with_a_captured_layout_still_runs_eagerly(two_to_one) -> None:
    # The graph for this exact FFN layout exists, but the attention side is not decoding,
    # so it is eager; the FFN rank must not replay on its own.
    topology, table = two_to_one
    plan = plan_step([RankStep(4, 1, False), decode(4)], topology, table)
    assert plan.ffn[0].key in table.captured
    assert [p.mode for p in plan.attention + plan.ffn] == ["eager"] * 3


def test_uneven_decode_and_even_decode_get_different_keys(two_to_one) -> None:
    topology, table = two_to_one
    uneven = plan_step([decode(6), decode(2)], topology, table)
    even = plan_step([decode(4), decode(4)], topology, table)
    assert uneven.ffn[0].key != even.ffn[0].key
    assert [p.padded_rows for p in uneven.attention] == [8, 8]
    assert uneven.ffn[0].mode == "replay"
    eager_table = GraphTable("none")
    eager_uneven = plan_step([decode(6), decode(2)], topology, eager_table)
    eager_even = plan_step([decode(4), decode(4)], topology, eager_table)
    assert eager_uneven.ffn[0].key == ("ffn", 2, ((6,), (2,)), (6,))
    assert eager_even.ffn[0].key == ("ffn", 2, ((4,), (4,)), (4,))


def test_uneven_peers_pad_to_one_tile() -> None:
    topology = Topology.parse("4A2F")
    table = warmed_table(topology, "full_decode_only", (1, 2, 4, 8, 16), warm=(16,))
    plan = plan_step([decode(16), decode(16), decode(16), decode(4)], topology, table)
    assert [p.padded_rows for p in plan.attention] == [16] * 4
    assert [p.ubatch_real_rows for p in plan.attention] == [(16,), (16,), (16,), (4,)]
    assert {p.tile_rows for p in plan.attention + plan.ffn} == {(16,)}
    assert [p.receive_rows for p in plan.ffn] == [(32,), (32,)]
    assert [p.mode for p in plan.attention + plan.ffn] == ["replay"] * 6


# ---------------------------------------------------------------- concrete layouts


def test_graph_padding_keeps_real_rows_in_front() -> None:
    topology = Topology.parse("colocated")
    plan = plan_step([RankStep(5, 2, False)], topology, GraphTable("full", (4, 8)), ubatches=2)
    (rank,) = plan.attention
    assert (rank.padded_rows, rank.ubatch_rows, rank.ubatch_real_rows) == (8, (4, 4), (4, 1))
    assert (rank.tile_rows, rank.ffn_rank, rank.mode) == ((0, 0), None, "capture")
    assert rank.key == ("attention", 0, (4, 4), (0, 0), "mixed")
    assert plan.ffn == ()


def test_eager_ubatches_share_the_largest_tile() -> None:
    topology = Topology.parse("2A1F")
    plan = plan_step([RankStep(7, 1, False), decode(1)], topology, GraphTable(), ubatches=2)
    assert [p.ubatch_rows for p in plan.attention] == [(4, 3), (1, 0)]
    assert [p.tile_rows for p in plan.attention] == [(4, 3), (4, 3)]
    assert plan.ffn[0].receive_rows == (8, 6)


def test_idle_member_of_a_graph_group_pads_and_captures() -> None:
    topology = Topology.parse("3A2F")
    table = GraphTable("full_decode_only", (2, 4))
    plan = plan_step([decode(3), RankStep(9, 3, False), IDLE], topology, table)
    group0 = [plan.attention[0], plan.attention[2], plan.ffn[0]]
    assert [p.mode for p in group0] == ["capture"] * 3
    assert [plan.attention[0].padded_rows, plan.attention[2].padded_rows] == [4, 4]
    assert plan.attention[2].ubatch_real_rows == (0,)
    assert (plan.attention[1].mode, plan.ffn[1].mode) == ("eager", "eager")
    assert plan.ffn[1].receive_rows == (9,)


def test_a_graph_captured_by_one_group_is_not_replayed_by_another() -> None:
    topology = Topology.parse("4A2F")
    table = GraphTable("full_decode_only", (2, 4))
    prefill = RankStep(3, 1, False)
    first = plan_step([decode(2), prefill, decode(2), prefill], topology, table)
    assert [p.mode for p in first.ffn] == ["capture", "eager"]
    table = table.with_captured(first.capture_keys)
    second = plan_step([prefill, decode(2), prefill, decode(2)], topology, table)
    assert [p.mode for p in second.ffn] == ["eager", "capture"]
    assert [p.mode for p in second.attention] == ["eager", "capture", "eager", "capture"]


def test_sizes_above_the_largest_capture_run_eagerly() -> None:
    topology = Topology.parse("2A1F")
    table = warmed_table(topology, "full", (4, 8), warm=(4, 8))
    plan = plan_step([decode(9), decode(1)], topology, table)
    assert [p.mode for p in plan.attention + plan.ffn] == ["eager"] * 3
    assert [p.padded_rows for p in plan.attention] == [9, 1]


def test_keys_are_injective_over_small_exhaustive_sweep() -> None:
    topology = Topology.parse("2A1F")
    layouts: dict[tuple, tuple] = {}
    reports = [IDLE] + [RankStep(n, n, u) for n in range(1, 11) for u in (False, True)]
    reports += [RankStep(n, 1, False) for n in range(2, 11)]
    for mode, ubatches in itertools.product(GRAPH_MODES, range(1, 5)):
        table = GraphTable(mode, (1, 2, 4, 8))
        for pair in itertools.product(reports, repeat=2):
            plan = plan_step(pair, topology, table, ubatches)
            (ffn_plan,) = plan.ffn
            layout = (tuple(p.ubatch_rows for p in plan.attention), ffn_plan.tile_rows)
            if ffn_plan.key is not None:
                assert layouts.setdefault(ffn_plan.key, layout) == layout
    assert len(layouts) > 100


def test_log_records() -> None:
    topology = Topology.parse("3A2F")
    plan = plan_step([decode(2), IDLE, RankStep(5, 2, False)], topology, GraphTable())
    records = plan.log_records(step=11)
    assert [(r["role"], r["rank"]) for r in records] == [
        ("attention", 0),
        ("attention", 1),
        ("attention", 2),
        ("ffn", 3),
        ("ffn", 4),
    ]
    keys = {"step", "role", "rank", "real_rows", "padded_rows", "tile_rows", "peers", "mode", "key"}
    # Attention lines also carry the real rows of each ubatch (what each peer's tile must hold).
    assert all(
        set(r) - keys == ({"ubatch_real_rows"} if r["role"] == "attention" else set())
        and keys <= set(r)
        for r in records
    )
    assert records[3] == {
        "step": 11,
        "role": "ffn",
        "rank": 3,
        "real_rows": 7,
        "padded_rows": 10,
        "tile_rows": [5],
        "peers": [0, 2],
        "mode": "eager",
        "key": ["ffn", 3, [[2], [5]], [5]],
    }
    assert records[1]["peers"] == [4] and records[1]["key"] is None
    assert json.loads(json.dumps(records)) == records
    colocated = plan_step([decode(1)], Topology.parse("colocated"), GraphTable()).log_records(0)
    assert colocated[0]["peers"] == [] and colocated[0]["tile_rows"] == [0]


# ---------------------------------------------------------------- validation


def test_capture_reports() -> None:
    assert capture_reports(8, Topology.parse("3A2F")) == (decode(8),) * 3
    with pytest.raises(ValueError, match="capture size must be an int >= 1, got 0"):
        capture_reports(0, Topology.parse("2A1F"))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ((-1, 0, False), "num_tokens must be an int >= 0, got -1"),
        ((1, -1, False), "num_reqs must be an int >= 0, got -1"),
        ((2, 3, False), r"num_tokens \(2\) must be >= num_reqs \(3\)"),
        ((4, 0, False), "must be zero together"),
        ((0, 0, True), "uniform_decode=True requires num_reqs > 0"),
        ((1, 1, 1), "uniform_decode must be a bool, got 1"),
        ((True, 1, False), "num_tokens must be an int >= 0, got True"),
    ],
)
def test_rank_step_validates(fields: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RankStep(*fields)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "piecewise"}, "graph mode must be one of .*'none'.*got 'piecewise'"),
        ({"sizes": (4, 2)}, r"strictly increasing, got \(4, 2\)"),
        ({"sizes": (2, 2)}, r"strictly increasing, got \(2, 2\)"),
        ({"sizes": (0, 2)}, "every capture size must be an int >= 1, got 0"),
        ({"captured": {("decode", 8)}}, "captured keys must be tuples starting with"),
    ],
)
def test_graph_table_validates(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GraphTable(**kwargs)


def test_graph_table_accessors() -> None:
    table = GraphTable("full", [1, 2, 4])
    assert table.sizes == (1, 2, 4) and table.largest == 4 and GraphTable().largest == 0
    key = ("attention", 0, (4,), (4,))
    grown = table.with_captured([key])
    assert grown.captured == frozenset({key}) and table.captured == frozenset()


def test_plan_step_validates_inputs() -> None:
    topology = Topology.parse("2A1F")
    with pytest.raises(ValueError, match=r"got 1 rank reports for topology 2A1F.*\(2\)"):
        plan_step([decode(1)], topology, GraphTable())
    for ubatches in (0, 5):
        message = rf"ubatches must be an int in \[1, 4\], got {ubatches}"
        with pytest.raises(ValueError, match=message):
            plan_step([decode(1), IDLE], topology, GraphTable(), ubatches)
    with pytest.raises(ValueError, match=r"reports\[1\] must be a RankStep"):
        plan_step([decode(1), (1, 1, True)], topology, GraphTable())
    plan = plan_step([decode(1), IDLE], topology, GraphTable())
    with pytest.raises(ValueError, match=r"rank must be in \[0, 3\), got 3"):
        plan.for_rank(3)


def test_plans_reject_inconsistent_layouts() -> None:
    with pytest.raises(ValueError, match="rank 0: a tile is smaller than its ubatch"):
        AttentionRankPlan(0, 2, 3, 3, (3,), (3,), (2,), "eager", ("attention", 0, (3,), (2,)))
    with pytest.raises(ValueError, match="rank 0: key must be None exactly when idle"):
        AttentionRankPlan(0, 2, 0, 0, (0,), (0,), (0,), "idle", ("attention", 0, (0,), (0,)))
    with pytest.raises(ValueError, match=r"FFN rank 2: receive_rows != peers x tile_rows"):
        FFNRankPlan(2, (0, 1), 4, (2,), (2,), "eager", ("ffn", 2, ((2,), (2,)), (2,)))
