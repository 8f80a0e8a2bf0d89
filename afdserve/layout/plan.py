"""The step plan: the one place that decides every rank's layout for one step.

Every rank all-gathers the attention ranks' `RankStep` reports and calls
`plan_step(reports, topology, graph_table, ubatches)`. The function is pure (no torch, no I/O, no
clock), so equal inputs give an equal `StepPlan` on every rank. Nothing else in afdserve derives a
row count, a peer set, a tile size, a graph key or a run mode; the field reports in
`shared/seeds/` are what happens when two places derive them and disagree.

A *group* is an FFN rank together with its peers (attention ranks r with r mod F == f). When
colocated (F == 0) every attention rank is a group of its own, with no FFN rank and no tiles.
With m ubatches, attention of ubatch u + 1 overlaps FFN of ubatch u.

Rules:
1. `len(reports) == A` and `1 <= ubatches <= 4`.
2. A group with no real rows is *idle*: every member and its FFN rank get mode "idle", zero rows,
   zero tiles and key None. No exchange happens for that group.
3. A group may use a graph when the graph mode allows it ("none": never; "full_decode_only": every
   member with work is a uniform decode; "full": always) and its largest real row count is at most
   the largest capture size.
4. Graph group: size = the smallest capture size >= the group's largest real count. Every member,
   idle members included, computes `size` rows split by `split_rows(size, m)`; tile = that split.
   Eager group: every member computes its real rows split by `split_rows(real, m)`; the tile of
   ubatch u is the largest member's rows in ubatch u, and smaller members pad up to it.
   Real rows always occupy the first rows of the padded batch, so a member's real rows per ubatch
   are the overlap of [0, real) with that ubatch's row range.
5. Keys spell out the layout, never a sum two layouts can share:
   attention key = ("attention", rank, ubatch_rows, tile_rows),
   FFN key       = ("ffn", rank, (ubatch_rows of each peer, in peer order), tile_rows).
   The global rank is part of the key because a group may capture a graph while another group
   runs eagerly; a key in `GraphTable.captured` must mean "this rank holds this graph".
6. Modes: a graph group replays when every key of the group (members and FFN rank) is captured,
   otherwise the whole group captures together. An eager group runs "eager" on every member and on
   its FFN rank. So an FFN rank replays only when all its peers replay: an eager attention step
   (prefill, chunked prefill, a size above the largest capture) makes its FFN rank eager even when
   a graph with the same key exists.

Every peer sends exactly `tile_rows[u]` rows per layer in ubatch u and its FFN rank receives
`len(peers) * tile_rows[u]`; pad rows carry zero hidden states and token id -1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from afdserve.layout.topology import Topology

RunMode = Literal["idle", "eager", "capture", "replay"]
RUN_MODES = ("idle", "eager", "capture", "replay")
GRAPH_MODES = ("none", "full_decode_only", "full")
MAX_UBATCHES = 4

# ("attention" | "ffn", rank, ...nested tuples of ints); hashable, and JSON-able as nested lists.
GraphKey = tuple


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class RankStep:
    """What one attention rank's scheduler reports for the coming step."""

    num_tokens: int
    num_reqs: int
    uniform_decode: bool  # every request decodes exactly one token

    def __post_init__(self) -> None:
        _check_int("num_tokens", self.num_tokens, 0)
        _check_int("num_reqs", self.num_reqs, 0)
        if not isinstance(self.uniform_decode, bool):
            raise ValueError(f"uniform_decode must be a bool, got {self.uniform_decode!r}")
        if self.num_tokens < self.num_reqs:
            raise ValueError(
                f"num_tokens ({self.num_tokens}) must be >= num_reqs ({self.num_reqs}): "
                f"every scheduled request computes at least one token"
            )
        if (self.num_tokens == 0) != (self.num_reqs == 0):
            raise ValueError(
                f"num_tokens ({self.num_tokens}) and num_reqs ({self.num_reqs}) must be zero "
                f"together: a step with requests computes tokens and vice versa"
            )
        if self.uniform_decode and not self.num_tokens == self.num_reqs > 0:
            raise ValueError(
                f"uniform_decode=True requires num_tokens == num_reqs > 0 (one token per "
                f"request), got num_tokens={self.num_tokens}, num_reqs={self.num_reqs}"
            )


@dataclass(frozen=True)
class GraphTable:
    """Graph policy, capture sizes and the keys captured so far (by all ranks together)."""

    mode: str = "none"
    sizes: tuple[int, ...] = ()
    captured: frozenset[GraphKey] = frozenset()

    def __post_init__(self) -> None:
        if self.mode not in GRAPH_MODES:
            raise ValueError(f"graph mode must be one of {GRAPH_MODES}, got {self.mode!r}")
        object.__setattr__(self, "sizes", tuple(self.sizes))
        object.__setattr__(self, "captured", frozenset(self.captured))
        for size in self.sizes:
            _check_int("every capture size", size, 1)
        if any(a >= b for a, b in zip(self.sizes, self.sizes[1:], strict=False)):
            raise ValueError(f"capture sizes must be strictly increasing, got {self.sizes}")
        for key in self.captured:
            if not isinstance(key, tuple) or not key or key[0] not in ("attention", "ffn"):
                raise ValueError(
                    f"captured keys must be tuples starting with 'attention' or 'ffn', got {key!r}"
                )

    @property
    def largest(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def with_captured(self, keys: Iterable[GraphKey]) -> GraphTable:
        return dataclasses.replace(self, captured=self.captured | frozenset(keys))


def _check_mode_and_key(mode: str, key: GraphKey | None, rank: int) -> None:
    if mode not in RUN_MODES:
        raise ValueError(f"rank {rank}: mode must be one of {RUN_MODES}, got {mode!r}")
    if (key is None) != (mode == "idle"):
        raise ValueError(f"rank {rank}: key must be None exactly when idle, got {mode} {key!r}")


@dataclass(frozen=True)
class AttentionRankPlan:
    rank: int  # global rank, equal to the attention index
    ffn_rank: int | None  # global rank of the serving FFN rank; None when colocated
    real_rows: int
    padded_rows: int  # rows this rank's forward computes, real + pad
    ubatch_real_rows: tuple[int, ...]
    ubatch_rows: tuple[int, ...]  # padded rows per ubatch
    tile_rows: tuple[int, ...]  # rows sent to and received from the FFN rank per ubatch
    mode: RunMode
    key: GraphKey | None

    def __post_init__(self) -> None:
        # Only plan_step builds these; the checks make a planner bug fail where it happens.
        per_ubatch = (self.ubatch_real_rows, self.ubatch_rows, self.tile_rows)
        if len({len(rows) for rows in per_ubatch}) != 1:
            raise ValueError(f"rank {self.rank}: per-ubatch tuples differ in length: {self}")
        totals = (sum(self.ubatch_real_rows), sum(self.ubatch_rows))
        if totals != (self.real_rows, self.padded_rows):
            raise ValueError(f"rank {self.rank}: per-ubatch rows do not add up: {self}")
        pairs = list(zip(self.ubatch_real_rows, self.ubatch_rows, self.tile_rows, strict=True))
        if any(real > rows for real, rows, _ in pairs):
            raise ValueError(f"rank {self.rank}: a ubatch holds more real rows than rows: {self}")
        if self.ffn_rank is not None and any(tile < rows for _, rows, tile in pairs):
            raise ValueError(f"rank {self.rank}: a tile is smaller than its ubatch: {self}")
        _check_mode_and_key(self.mode, self.key, self.rank)

    @property
    def ubatch_bounds(self) -> tuple[tuple[int, int], ...]:
        """(first row, end row) of every ubatch in the padded batch, in order."""
        bounds, start = [], 0
        for rows in self.ubatch_rows:
            bounds.append((start, start + rows))
            start += rows
        return tuple(bounds)


@dataclass(frozen=True)
class FFNRankPlan:
    rank: int  # global rank
    peers: tuple[int, ...]  # attention ranks served, increasing
    real_rows: int  # sum of the peers' real rows
    tile_rows: tuple[int, ...]  # per ubatch, identical to every peer's tile_rows
    receive_rows: tuple[int, ...]  # per ubatch, len(peers) * tile_rows
    mode: RunMode
    key: GraphKey | None

    def __post_init__(self) -> None:
        if not self.peers or list(self.peers) != sorted(set(self.peers)):
            raise ValueError(f"FFN rank {self.rank}: peers must be increasing, got {self.peers}")
        if self.receive_rows != tuple(len(self.peers) * tile for tile in self.tile_rows):
            raise ValueError(f"FFN rank {self.rank}: receive_rows != peers x tile_rows: {self}")
        _check_mode_and_key(self.mode, self.key, self.rank)

    def peer_rows(self, ubatch: int) -> tuple[tuple[int, int, int], ...]:
        """(peer, first row, end row) of every peer's tile in the receive buffer of `ubatch`:
        tiles sit in peer order, each `tile_rows[ubatch]` rows long."""
        tile = self.tile_rows[ubatch]
        return tuple((peer, i * tile, (i + 1) * tile) for i, peer in enumerate(self.peers))


def _jsonable(value: Any) -> Any:
    return [_jsonable(item) for item in value] if isinstance(value, tuple) else value


def _record(
    step: int,
    role: str,
    plan: AttentionRankPlan | FFNRankPlan,
    padded_rows: int,
    peers: list[int],
) -> dict[str, Any]:
    return {
        "step": step,
        "role": role,
        "rank": plan.rank,
        "real_rows": plan.real_rows,
        "padded_rows": padded_rows,
        "tile_rows": list(plan.tile_rows),
        "peers": peers,
        "mode": plan.mode,
        "key": _jsonable(plan.key),
    }


@dataclass(frozen=True)
class StepPlan:
    ubatches: int
    attention: tuple[AttentionRankPlan, ...]  # indexed by attention rank
    ffn: tuple[FFNRankPlan, ...]  # indexed by FFN index f

    def __post_init__(self) -> None:
        for index, plan in enumerate(self.attention):
            if plan.rank != index:
                raise ValueError(f"attention[{index}] holds the plan of rank {plan.rank}")
        for index, plan in enumerate(self.ffn):
            if plan.rank != len(self.attention) + index:
                raise ValueError(f"ffn[{index}] holds the plan of rank {plan.rank}")

    def for_rank(self, rank: int) -> AttentionRankPlan | FFNRankPlan:
        """The plan of a global rank."""
        world_size = len(self.attention) + len(self.ffn)
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        if rank < len(self.attention):
            return self.attention[rank]
        return self.ffn[rank - len(self.attention)]

    @property
    def has_work(self) -> bool:
        return any(plan.real_rows > 0 for plan in self.attention)

    @property
    def capture_keys(self) -> frozenset[GraphKey]:
        """Keys captured by this step; feed them to `GraphTable.with_captured` afterwards."""
        plans: tuple[AttentionRankPlan | FFNRankPlan, ...] = self.attention + self.ffn
        return frozenset(plan.key for plan in plans if plan.mode == "capture")

    def log_records(self, step: int) -> list[dict[str, Any]]:
        """One JSON-able record per rank, in global rank order (for --log-step-plan)."""
        records: list[dict[str, Any]] = []
        for plan in self.attention:
            peers = [] if plan.ffn_rank is None else [plan.ffn_rank]
            record = _record(step, "attention", plan, plan.padded_rows, peers)
            record["ubatch_real_rows"] = list(plan.ubatch_real_rows)
            records.append(record)
        for plan in self.ffn:
            records.append(_record(step, "ffn", plan, sum(plan.receive_rows), list(plan.peers)))
        return records


def split_rows(rows: int, ubatches: int) -> tuple[int, ...]:
    """Split `rows` into `ubatches` contiguous near-equal chunks.

    The first `rows % ubatches` chunks hold one extra row; chunks are 0 when rows < ubatches.
    """
    _check_int("rows", rows, 0)
    _check_int("ubatches", ubatches, 1)
    base, extra = divmod(rows, ubatches)
    return tuple(base + 1 if u < extra else base for u in range(ubatches))


def capture_reports(size: int, topology: Topology) -> tuple[RankStep, ...]:
    """Warm-up reports: every attention rank decodes `size` requests, one token each."""
    _check_int("capture size", size, 1)
    return tuple(RankStep(size, size, True) for _ in range(topology.attention_ranks))


def warmup_reports(table: GraphTable, topology: Topology) -> list[tuple[RankStep, ...]]:
    """The lockstep warm-up, the same on every rank: one capture step per capture size, largest
    first (smaller graphs then share the largest one's memory pool)."""
    return [capture_reports(size, topology) for size in sorted(table.sizes, reverse=True)]


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


def _groups(topology: Topology) -> list[tuple[int | None, tuple[int, ...]]]:
    """(global FFN rank or None, member attention ranks) for every group."""
    if topology.colocated:
        return [(None, (rank,)) for rank in range(topology.attention_ranks)]
    return [(topology.attention_ranks + f, topology.peers(f)) for f in range(topology.ffn_ranks)]


def _plan_group(
    ffn_rank: int | None,
    members: tuple[int, ...],
    reports: tuple[RankStep, ...],
    table: GraphTable,
    ubatches: int,
) -> tuple[list[AttentionRankPlan], FFNRankPlan | None]:
    """Plans of one group: its member attention ranks and its FFN rank (None when colocated)."""
    group = [reports[rank] for rank in members]
    no_rows = (0,) * ubatches
    if all(report.num_tokens == 0 for report in group):
        idle = [
            AttentionRankPlan(rank, ffn_rank, 0, 0, no_rows, no_rows, no_rows, "idle", None)
            for rank in members
        ]
        if ffn_rank is None:
            return idle, None
        return idle, FFNRankPlan(ffn_rank, members, 0, no_rows, no_rows, "idle", None)

    size = _graph_size(group, table)
    if size is None:
        rows = {rank: split_rows(reports[rank].num_tokens, ubatches) for rank in members}
        tile = tuple(max(rows[rank][u] for rank in members) for u in range(ubatches))
    else:
        tile = split_rows(size, ubatches)
        rows = {rank: tile for rank in members}
    if ffn_rank is None:
        tile = no_rows

    keys: dict[int, GraphKey] = {rank: ("attention", rank, rows[rank], tile) for rank in members}
    if ffn_rank is not None:
        keys[ffn_rank] = ("ffn", ffn_rank, tuple(rows[rank] for rank in members), tile)
    mode: RunMode
    if size is None:
        mode = "eager"
    elif all(key in table.captured for key in keys.values()):
        mode = "replay"
    else:
        mode = "capture"

    member_plans = [
        AttentionRankPlan(
            rank=rank,
            ffn_rank=ffn_rank,
            real_rows=reports[rank].num_tokens,
            padded_rows=sum(rows[rank]),
            ubatch_real_rows=_real_per_ubatch(reports[rank].num_tokens, rows[rank]),
            ubatch_rows=rows[rank],
            tile_rows=tile,
            mode=mode,
            key=keys[rank],
        )
        for rank in members
    ]
    if ffn_rank is None:
        return member_plans, None
    ffn_plan = FFNRankPlan(
        rank=ffn_rank,
        peers=members,
        real_rows=sum(report.num_tokens for report in group),
        tile_rows=tile,
        receive_rows=tuple(len(members) * rows_u for rows_u in tile),
        mode=mode,
        key=keys[ffn_rank],
    )
    return member_plans, ffn_plan


def plan_step(
    reports: Sequence[RankStep],
    topology: Topology,
    graph_table: GraphTable,
    ubatches: int = 1,
) -> StepPlan:
    """Plan one step for every rank; see the module docstring for the rules."""
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
    for ffn_rank, members in _groups(topology):
        member_plans, ffn_plan = _plan_group(ffn_rank, members, reports, graph_table, ubatches)
        attention.extend(member_plans)
        if ffn_plan is not None:
            ffn.append(ffn_plan)
    return StepPlan(
        ubatches=ubatches,
        attention=tuple(sorted(attention, key=lambda plan: plan.rank)),
        ffn=tuple(ffn),
    )
