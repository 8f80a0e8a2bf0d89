"""The step plan: the one place that decides every rank's layout for one step.

Every rank all-gathers the attention ranks' `RankStep` reports and calls
`plan_step(reports, topology, graph_table, ubatches, draft_passes)`. The function is pure (no
torch, no I/O, no clock), so equal inputs give an equal `StepPlan` on every rank. Nothing else
in afdserve derives a row count, a peer set, a tile size, a graph key or a run mode: two places
that derive one can disagree.

A *group* is an FFN rank together with its peers (attention ranks r with r mod F == f); colocated
(F == 0), every attention rank is a group of its own, with no FFN rank and no tiles. With m
ubatches, attention of ubatch u + 1 overlaps FFN of ubatch u. The numbered rules the plan follows
are in the comment block "the rules of plan_step" below.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from afdserve.layout.step import (
    DRAFT_TAGS,
    GRAPH_KINDS,
    GRAPH_MODES,
    MAX_UBATCHES,
    RUN_MODES,
    AttentionRankPlan,
    FFNRankPlan,
    GraphKey,
    GraphTable,
    RankStep,
    RunMode,
    StepPlan,
    _check_int,
)
from afdserve.layout.topology import Topology

__all__ = [
    "DRAFT_TAGS",
    "GRAPH_KINDS",
    "GRAPH_MODES",
    "MAX_UBATCHES",
    "RUN_MODES",
    "AttentionRankPlan",
    "FFNRankPlan",
    "GraphKey",
    "GraphTable",
    "RankStep",
    "RunMode",
    "StepPlan",
    "capture_reports",
    "plan_step",
    "split_rows",
    "warmup_reports",
]


def split_rows(rows: int, ubatches: int) -> tuple[int, ...]:
    """Split `rows` into `ubatches` contiguous near-equal chunks.

    The first `rows % ubatches` chunks hold one extra row; chunks are 0 when rows < ubatches.
    """
    _check_int("rows", rows, 0)
    _check_int("ubatches", ubatches, 1)
    base, extra = divmod(rows, ubatches)
    return tuple(base + 1 if u < extra else base for u in range(ubatches))


def capture_reports(size: int, topology: Topology, kind: str = "decode") -> tuple[RankStep, ...]:
    """Warm-up reports of a graph of `kind`: every attention rank decodes `size` requests, one
    token each; for "mixed", the same rows as one-token prefill chunks (not decodes), so the
    step's bounds (a draft pass's included) are the decode step's."""
    _check_int("capture size", size, 1)
    if kind not in GRAPH_KINDS:
        raise ValueError(f"graph kind must be one of {GRAPH_KINDS}, got {kind!r}")
    uniform = kind == "decode"
    return tuple(RankStep(size, size, uniform) for _ in range(topology.attention_ranks))


def warmup_reports(table: GraphTable, topology: Topology) -> list[tuple[RankStep, ...]]:
    """The lockstep warm-up, the same on every rank: one capture step per capture size and kind
    the mode captures, largest first (smaller graphs then share the largest one's memory pool),
    a size's mixed graph, the larger, before its decode one."""
    kinds = ("mixed", "decode") if table.mode == "full" else ("decode",)
    return [
        capture_reports(size, topology, kind)
        for size in sorted(table.sizes, reverse=True)
        for kind in kinds
    ]


# ---------------------------------------------------------------- the rules of plan_step
# 1. `len(reports) == A` and `1 <= ubatches <= 4`.
# 2. A group with no real rows is *idle*: every member and its FFN rank get mode "idle", zero
#    rows, zero tiles and key None. No exchange happens for that group.
# 3. A group may use a graph when the graph mode allows it ("none": never; "full_decode_only":
#    every member with work is a uniform decode; "full": always) and its largest real row count
#    is at most the largest capture size.
# 4. Graph group: size = the smallest capture size >= the group's largest real count. Every
#    member, idle members included, computes `size` rows split by `split_rows(size, m)`; tile =
#    that split. Eager group: every member computes its real rows split by `split_rows(real, m)`;
#    the tile of ubatch u is the largest member's rows in ubatch u, and smaller members pad up to
#    it. Real rows always occupy the first rows of the padded batch, so a member's real rows per
#    ubatch are the overlap of [0, real) with that ubatch's row range.
# 5. Keys spell out the layout, never a sum two layouts can share:
#    attention key = ("attention", rank, ubatch_rows, tile_rows, kind),
#    FFN key       = ("ffn", rank, (ubatch_rows of each peer, in peer order), tile_rows).
#    The global rank is part of the key because a group may capture a graph while another group
#    runs eagerly; a key in `GraphTable.captured` must mean "this rank holds this graph".
#    kind (`GRAPH_KINDS`) is each member's own: "decode" when its report is a uniform decode (or
#    it has no rows), else "mixed". A decode graph launches the decode attention for at most
#    1 + k query rows a request, a mixed one the varlen path over queries of any length; so
#    under "full" a decode-only step replays exactly the graph "full_decode_only" captures, and
#    a step with prefill chunks the mixed graph of its size. The FFN key has no kind: an FFN
#    rank's work is its peers' rows whatever their attention ran, so one FFN graph of a layout
#    pairs with both kinds.
# 6. Modes: a graph group replays when every key of the group (members and FFN rank) is captured,
#    otherwise the whole group captures together: every rank of it runs a capture's two passes
#    (the warm run, then the step), a rank whose key is held already over the graph it holds
#    (an FFN rank when a member captures its other kind). An eager group runs "eager" on every
#    member and on its FFN rank. So an FFN rank replays only when all its peers replay: an eager
#    attention step (prefill, chunked prefill, a size above the largest capture) makes its FFN
#    rank eager even when a graph with the same key exists.
# Every peer sends exactly `tile_rows[u]` rows per layer in ubatch u and its FFN rank receives
# `len(peers) * tile_rows[u]`; pad rows carry zero hidden states and token id -1.
#
# Expert parallelism (`topology.expert_parallel`): the FFN ranks exchange rows among themselves,
# so they must agree on the sizes of that exchange and on one run mode, and each of them replays
# only when every attention rank whose rows reach the group replays. So the whole world is one
# group: rules 2-6 apply with every attention rank as a member and every FFN rank as its FFN side.
# Each FFN rank still receives from its own peers (r mod F == f, none for f >= A); in addition
# 7. group_rows[u] = the largest receive_rows[u] in the group: every FFN rank contributes exactly
#    that many rows to the group's exchange in ubatch u (its received rows, then pad rows that go
#    to no expert), so the exchange holds every row of the group by construction and drops none;
# 8. the FFN key also spells out group_rows: ("ffn", rank, peers' ubatch_rows, tile_rows,
#    group_rows).
#
# Draft passes (`draft_passes` = k, speculative decoding's MTP method): after the main layers
# each attention rank runs the draft layer k times, over rows that depend on the tokens the step
# samples, so their count is known only after the control round. The plan gives each pass the
# rows that bound it instead:
# 9. pass 0 covers the rows the step keeps (at most the report's num_tokens, a decode's shape
#    when the step is one: each request keeps at most its 1 + k rows), pass j >= 1 one chained
#    draft a request (at most its num_reqs; a decode's shape always). Each pass is planned by
#    rules 1-8 as a step of its own over those reports, in one ubatch, and rides in every rank
#    plan's `drafts`. A rank fills a pass's front rows with its real ones and pads the rest, as
#    in any step; the FFN ranks run the draft layer over each pass like any layer, from their
#    plan alone.
# 10. A draft pass's keys are the keys rule 5 gives its layout, tagged with the pass's kind
#    (`DRAFT_TAGS`: pass 0 reads the main model's rows, a chained pass the draft's own output,
#    so the attention side's graphs differ), never a main step's key. Passes are planned in
#    order against the table and the keys the passes before them capture, so a second pass of
#    a key captured in the same step replays it.


def _real_per_ubatch(real: int, ubatch_rows: tuple[int, ...]) -> tuple[int, ...]:
    # Real rows fill the padded batch from the front: ubatch u covers [start, start + rows).
    overlap, start = [], 0
    for rows in ubatch_rows:
        overlap.append(min(rows, max(real - start, 0)))
        start += rows
    return tuple(overlap)


def _graph_size(group: Sequence[RankStep], table: GraphTable) -> int | None:
    """The capture size the group pads to, or None when the group runs eagerly."""
    if table.mode == "none":
        return None
    if table.mode == "full_decode_only" and not all(
        report.uniform_decode for report in group if report.num_tokens > 0
    ):
        return None
    largest_real = max(report.num_tokens for report in group)
    return next((size for size in table.sizes if size >= largest_real), None)


def _groups(topology: Topology) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(global FFN ranks, member attention ranks) for every group; no FFN ranks when colocated."""
    if topology.colocated:
        return [((), (rank,)) for rank in range(topology.attention_ranks)]
    if topology.expert_parallel:
        return [(topology.ffn_group, tuple(range(topology.attention_ranks)))]
    return [((topology.attention_ranks + f,), topology.peers(f)) for f in range(topology.ffn_ranks)]


def _peer_index(rank: int, ffn_rank: int | None, peers: dict[int, tuple[int, ...]]) -> int:
    return 0 if ffn_rank is None else peers[ffn_rank].index(rank)


def _plan_group(
    ffn_ranks: tuple[int, ...],
    members: tuple[int, ...],
    reports: tuple[RankStep, ...],
    table: GraphTable,
    ubatches: int,
    topology: Topology,
    tag: str | None = None,
) -> tuple[list[AttentionRankPlan], list[FFNRankPlan]]:
    """Plans of one group: its member attention ranks and its FFN ranks."""
    group = [reports[rank] for rank in members]
    peers = {f: topology.peers(topology.ffn_index(f)) for f in ffn_ranks}
    home = {rank: topology.ffn_rank_of(rank) for rank in members}
    expert = topology.expert_parallel
    if all(report.num_tokens == 0 for report in group):
        return _idle_group(ffn_ranks, members, peers, home, ubatches, topology)

    size = _graph_size(group, table)
    rows, tile = _rows_and_tile(size, members, reports, ubatches)
    if not ffn_ranks:
        tile = (0,) * ubatches
    receive = {f: tuple(len(peers[f]) * rows_u for rows_u in tile) for f in ffn_ranks}
    group_rows = (
        tuple(max(receive[f][u] for f in ffn_ranks) for u in range(ubatches)) if expert else ()
    )
    kinds = {rank: _kind(reports[rank]) for rank in members}
    keys = _keys(members, peers, rows, tile, group_rows if expert else None, kinds, tag)
    mode = _mode(size, keys, table)

    member_plans = [
        AttentionRankPlan(
            rank=rank,
            ffn_rank=home[rank],
            real_rows=reports[rank].num_tokens,
            padded_rows=sum(rows[rank]),
            ubatch_real_rows=_real_per_ubatch(reports[rank].num_tokens, rows[rank]),
            ubatch_rows=rows[rank],
            tile_rows=tile,
            mode=mode,
            key=keys[rank],
            peer_index=_peer_index(rank, home[rank], peers),
        )
        for rank in members
    ]
    ffn_plans = [
        FFNRankPlan(
            rank=f,
            peers=peers[f],
            real_rows=sum(reports[rank].num_tokens for rank in peers[f]),
            tile_rows=tile,
            receive_rows=receive[f],
            mode=mode,
            key=keys[f],
            group=topology.ffn_group,
            group_rows=group_rows,
        )
        for f in ffn_ranks
    ]
    return member_plans, ffn_plans


def _idle_group(
    ffn_ranks: tuple[int, ...],
    members: tuple[int, ...],
    peers: dict[int, tuple[int, ...]],
    home: dict[int, int | None],
    ubatches: int,
    topology: Topology,
) -> tuple[list[AttentionRankPlan], list[FFNRankPlan]]:
    """Rule 2: zero rows, zero tiles, mode "idle" and no key on every rank of the group."""
    no_rows = (0,) * ubatches
    idle = [
        AttentionRankPlan(rank, home[rank], 0, 0, no_rows, no_rows, no_rows, "idle", None)
        for rank in members
    ]
    ffn_idle = [
        FFNRankPlan(
            f,
            peers[f],
            0,
            no_rows,
            no_rows,
            "idle",
            None,
            group=topology.ffn_group,
            group_rows=no_rows if topology.expert_parallel else (),
        )
        for f in ffn_ranks
    ]
    return idle, ffn_idle


def _rows_and_tile(
    size: int | None, members: tuple[int, ...], reports: tuple[RankStep, ...], ubatches: int
) -> tuple[dict[int, tuple[int, ...]], tuple[int, ...]]:
    """Rule 4: (each member's rows per ubatch, the tile) of a graph group (`size`) or an eager one
    (None)."""
    if size is None:
        rows = {rank: split_rows(reports[rank].num_tokens, ubatches) for rank in members}
        tile = tuple(max(rows[rank][u] for rank in members) for u in range(ubatches))
    else:
        tile = split_rows(size, ubatches)
        rows = {rank: tile for rank in members}
    return rows, tile


def _kind(report: RankStep) -> str:
    """Rule 5: the kind of attention graph a member's step needs."""
    return "decode" if report.uniform_decode or report.num_tokens == 0 else "mixed"


def _keys(
    members: tuple[int, ...],
    peers: dict[int, tuple[int, ...]],
    rows: dict[int, tuple[int, ...]],
    tile: tuple[int, ...],
    group_rows: tuple[int, ...] | None,
    kinds: dict[int, str],
    tag: str | None = None,
) -> dict[int, GraphKey]:
    """Rules 5, 8 and 10: each rank's graph key; `group_rows` only in an expert-parallel
    group, `tag` only in a draft pass (after the kind)."""
    keys: dict[int, GraphKey] = {
        rank: ("attention", rank, rows[rank], tile, kinds[rank]) for rank in members
    }
    for f, its_peers in peers.items():
        keys[f] = ("ffn", f, tuple(rows[rank] for rank in its_peers), tile)
        if group_rows is not None:
            keys[f] += (group_rows,)
    if tag is not None:
        keys = {rank: (*key, tag) for rank, key in keys.items()}
    return keys


def _mode(size: int | None, keys: dict[int, GraphKey], table: GraphTable) -> RunMode:
    """Rule 6: one mode for the whole group."""
    if size is None:
        return "eager"
    if all(key in table.captured for key in keys.values()):
        return "replay"
    return "capture"


def _draft_reports(reports: tuple[RankStep, ...], draft: int) -> tuple[RankStep, ...]:
    """Rule 9: the reports that bound draft pass `draft` (0: the kept rows, a decode's shape
    when the step is one; then one row a request)."""
    return tuple(
        RankStep(report.num_tokens, report.num_reqs, report.uniform_decode)
        if draft == 0
        else RankStep(report.num_reqs, report.num_reqs, report.num_reqs > 0)
        for report in reports
    )


def _draft_plans(
    reports: tuple[RankStep, ...], topology: Topology, table: GraphTable, passes: int
) -> list[StepPlan]:
    """Rules 9 and 10: each pass planned against the table and the keys of the passes before
    it."""
    plans = []
    for j in range(passes):
        tag = DRAFT_TAGS[min(j, 1)]
        plan = _plan_main(_draft_reports(reports, j), topology, table, 1, tag)
        table = table.with_captured(plan.capture_keys)
        plans.append(plan)
    return plans


def plan_step(
    reports: Sequence[RankStep],
    topology: Topology,
    graph_table: GraphTable,
    ubatches: int = 1,
    draft_passes: int = 0,
) -> StepPlan:
    """Plan one step for every rank, by the rules in the comment block above; with
    `draft_passes` each rank plan carries them (rule 9)."""
    _check_int("draft_passes", draft_passes, 0)
    plan = _plan_main(reports, topology, graph_table, ubatches)
    if not draft_passes:
        return plan
    passes = _draft_plans(tuple(reports), topology, graph_table, draft_passes)
    attention = tuple(
        dataclasses.replace(mine, drafts=tuple(p.attention[i] for p in passes))
        for i, mine in enumerate(plan.attention)
    )
    ffn = tuple(
        dataclasses.replace(mine, drafts=tuple(p.ffn[i] for p in passes))
        for i, mine in enumerate(plan.ffn)
    )
    return StepPlan(ubatches=plan.ubatches, attention=attention, ffn=ffn)


def _plan_main(
    reports: Sequence[RankStep],
    topology: Topology,
    graph_table: GraphTable,
    ubatches: int,
    tag: str | None = None,
) -> StepPlan:
    """Rules 1-8 (`tag`: a draft pass's kind, rule 10)."""
    reports = tuple(reports)
    if len(reports) != topology.attention_ranks:
        raise ValueError(
            f"got {len(reports)} rank reports for topology {topology}; need exactly one per "
            f"attention rank ({topology.attention_ranks})"
        )
    for index, report in enumerate(reports):
        if not isinstance(report, RankStep):
            raise ValueError(f"reports[{index}] must be a RankStep, got {report!r}")
    if (
        not isinstance(ubatches, int)
        or isinstance(ubatches, bool)
        or not (1 <= ubatches <= MAX_UBATCHES)
    ):
        raise ValueError(f"ubatches must be an int in [1, {MAX_UBATCHES}], got {ubatches!r}")

    attention: list[AttentionRankPlan] = []
    ffn: list[FFNRankPlan] = []
    for ffn_ranks, members in _groups(topology):
        member_plans, ffn_plans = _plan_group(
            ffn_ranks, members, reports, graph_table, ubatches, topology, tag
        )
        attention.extend(member_plans)
        ffn.extend(ffn_plans)
    return StepPlan(
        ubatches=ubatches,
        attention=tuple(sorted(attention, key=lambda plan: plan.rank)),
        ffn=tuple(sorted(ffn, key=lambda plan: plan.rank)),
    )
