"""The two kinds of attention graph (plan.py, rule 5): under `full` a decode-only step gets the
decode key, the very key `full_decode_only` gives it, and a step with prefill chunks the mixed
key of its size; the FFN key has no kind, so one FFN graph pairs with both; the warm-up
captures both kinds of every size under `full`, only decode under `full_decode_only`."""

from __future__ import annotations

from hypothesis import given, settings

from afdserve.layout.plan import GraphTable, RankStep, plan_step, warmup_reports
from afdserve.layout.topology import Topology

from .test_plan import IDLE, Scenario, decode, scenarios, warmed_table

PROPERTY = settings(max_examples=500, deadline=None, database=None)
SIZES = (1, 2, 4, 8)
CHUNK = RankStep(5, 2, False)  # a prefill chunk beside a decode: 5 rows, not uniform


def test_full_keys_a_decode_step_as_full_decode_only_does() -> None:
    topology = Topology.parse("colocated")
    full = warmed_table(topology, "full", SIZES, SIZES)
    decode_only = warmed_table(topology, "full_decode_only", SIZES, SIZES)
    (under_full,) = plan_step([decode(3)], topology, full).attention
    (under_decode_only,) = plan_step([decode(3)], topology, decode_only).attention
    assert under_full == under_decode_only
    assert under_full.key == ("attention", 0, (4,), (0,), "decode")
    assert (under_full.graph_kind, under_full.mode) == ("decode", "replay")
    # A verification step (1 + k rows a request) is a decode step too.
    (verify,) = plan_step([RankStep(6, 3, True)], topology, full).attention
    assert verify.key == ("attention", 0, (8,), (0,), "decode") and verify.mode == "replay"


def test_full_keys_a_mixed_step_apart() -> None:
    topology = Topology.parse("colocated")
    full = warmed_table(topology, "full", SIZES, SIZES)
    (mixed,) = plan_step([CHUNK], topology, full).attention
    assert mixed.key == ("attention", 0, (8,), (0,), "mixed")
    assert (mixed.graph_kind, mixed.mode, mixed.padded_rows) == ("mixed", "replay", 8)
    (decoding,) = plan_step([decode(5)], topology, full).attention
    assert decoding.key != mixed.key and decoding.padded_rows == mixed.padded_rows
    # One-token prefill chunks are not decodes: the mixed graph.
    (chunks,) = plan_step([RankStep(3, 3, False)], topology, full).attention
    assert chunks.graph_kind == "mixed"


def test_full_decode_only_is_unchanged_by_kinds() -> None:
    topology = Topology.parse("2A1F")
    table = warmed_table(topology, "full_decode_only", SIZES, SIZES)
    assert all(key[0] == "ffn" or key[4] == "decode" for key in table.captured)
    plan = plan_step([decode(3), CHUNK], topology, table)
    assert [p.mode for p in plan.attention + plan.ffn] == ["eager"] * 3
    assert [p.padded_rows for p in plan.attention] == [3, 5]
    plan = plan_step([decode(3), decode(2)], topology, table)
    assert [p.mode for p in plan.attention + plan.ffn] == ["replay"] * 3
    assert [p.graph_kind for p in plan.attention] == ["decode", "decode"]


def test_warmup_captures_both_kinds_under_full_only() -> None:
    topology = Topology.parse("2A1F")
    full = warmup_reports(GraphTable("full", (2, 8)), topology)
    assert full == [
        (RankStep(8, 8, False),) * 2,
        (RankStep(8, 8, True),) * 2,
        (RankStep(2, 2, False),) * 2,
        (RankStep(2, 2, True),) * 2,
    ]
    decode_only = warmup_reports(GraphTable("full_decode_only", (2, 8)), topology)
    assert decode_only == [(RankStep(8, 8, True),) * 2, (RankStep(2, 2, True),) * 2]
    assert warmup_reports(GraphTable("none"), topology) == []


def test_one_ffn_graph_pairs_with_both_kinds() -> None:
    """The warm-up's second kind of a size captures the attention graphs it lacks while the FFN
    key is held; then members of either kind replay beside one FFN graph."""
    topology = Topology.parse("2A1F")
    table = GraphTable("full", (4,))
    mixed_step, decode_step = warmup_reports(table, topology)
    first = plan_step(mixed_step, topology, table)
    table = table.with_captured(first.capture_keys)
    second = plan_step(decode_step, topology, table)
    assert [p.mode for p in second.attention + second.ffn] == ["capture"] * 3
    assert second.ffn[0].key == first.ffn[0].key and second.ffn[0].key in table.captured
    assert all(p.key not in table.captured for p in second.attention)
    table = table.with_captured(second.capture_keys)
    both = plan_step([decode(2), RankStep(4, 1, False)], topology, table)
    assert [p.graph_kind for p in both.attention] == ["decode", "mixed"]
    assert [p.mode for p in both.attention + both.ffn] == ["replay"] * 3
    assert both.ffn[0].key == first.ffn[0].key


def test_an_idle_member_pads_through_the_decode_graph() -> None:
    topology = Topology.parse("3A1F")
    table = warmed_table(topology, "full", SIZES, SIZES)
    plan = plan_step([RankStep(4, 1, False), IDLE, decode(1)], topology, table)
    assert [p.graph_kind for p in plan.attention] == ["mixed", "decode", "decode"]
    assert [p.mode for p in plan.attention + plan.ffn] == ["replay"] * 4


@PROPERTY
@given(scenarios())
def test_every_key_names_its_members_kind(scenario: Scenario) -> None:
    topology, table, ubatches, steps = scenario
    plan = plan_step(steps[0], topology, table, ubatches)
    for report, mine in zip(steps[0], plan.attention, strict=True):
        if mine.mode == "idle":
            assert mine.graph_kind is None
            continue
        uniform = report.uniform_decode or report.num_tokens == 0
        assert mine.graph_kind == ("decode" if uniform else "mixed")
        if mine.mode != "eager" and table.mode == "full_decode_only":
            assert mine.graph_kind == "decode"
    assert all(len(p.key) in (4, 5) and p.key[-1] != "decode" for p in plan.ffn if p.key)


@PROPERTY
@given(scenarios())
def test_full_warmup_leaves_no_capture_to_serving(scenario: Scenario) -> None:
    """After the whole warm-up, a step of any shape that fits the ladder replays."""
    topology, table, ubatches, steps = scenario
    table = warmed_table(topology, table.mode, table.sizes, table.sizes, ubatches)
    plan = plan_step(steps[0], topology, table, ubatches)
    assert all(p.mode != "capture" for p in plan.attention + plan.ffn)
