"""What the planner reads and writes: the attention ranks' reports, the graph table, and the
per-rank plans of one step (see plan.py for the rules that fill them). Each plan checks its own
invariants, so a planner bug fails where it happens."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

RunMode = Literal["idle", "eager", "capture", "replay"]
RUN_MODES = ("idle", "eager", "capture", "replay")
GRAPH_MODES = ("none", "full_decode_only", "full")
MAX_UBATCHES = 4
# The kinds of attention graph (plan.py, rule 5): "decode" when every segment is one decode (with
# its drafts when speculating), launching the decode attention; "mixed" when prefill chunks may
# sit beside decodes, launching the varlen path. `full` captures both, `full_decode_only` the first.
GRAPH_KINDS = ("decode", "mixed")
# The kinds of draft pass whose keys differ (plan.py, rule 10): pass 0 reads the main model's
# rows, a chained pass the draft layer's own previous output.
DRAFT_TAGS = ("draft:first", "draft:chain")

# ("attention" | "ffn", rank, ...nested tuples of ints[, kind][, draft tag]); hashable, and
# JSON-able as nested lists.
GraphKey = tuple


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class RankStep:
    """What one attention rank's scheduler reports for the coming step."""

    num_tokens: int
    num_reqs: int
    # Every request decodes one token, with its drafts when speculating (engine/speculative.py):
    # a verification step's k + 1 rows a request are still a decode step for the graphs.
    uniform_decode: bool

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
        if self.uniform_decode and not self.num_reqs > 0:
            raise ValueError(
                f"uniform_decode=True requires num_reqs > 0 (a decode step has requests), got "
                f"num_tokens={self.num_tokens}, num_reqs={self.num_reqs}"
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
        new = frozenset(keys) - self.captured
        if not new:  # every step records its keys: most add none, and need no new table
            return self
        return dataclasses.replace(self, captured=self.captured | new)


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
    # This rank's place among its FFN rank's peers (FFNRankPlan.peers): its tiles sit at that
    # position in the FFN rank's receive buffer. 0 when colocated.
    peer_index: int = 0
    # The draft passes after the main layers (MTP: the draft layer over the step's kept rows,
    # then each chained draft), one ubatch each, in order (plan.py, rule 9).
    drafts: tuple[AttentionRankPlan, ...] = ()

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
    def graph_kind(self) -> str | None:
        """The kind of graph the key names (`GRAPH_KINDS`, rule 5); None when idle."""
        return None if self.key is None else self.key[4]

    def ffn_rows(self, ubatch: int) -> tuple[int, int]:
        """(first row, end row) of this rank's tile in its FFN rank's receive buffer of `ubatch`;
        the FFN rank's `peer_rows` names the same rows."""
        tile = self.tile_rows[ubatch]
        return self.peer_index * tile, (self.peer_index + 1) * tile

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
    peers: tuple[int, ...]  # attention ranks served, increasing (empty only in an EP group)
    real_rows: int  # sum of the peers' real rows
    tile_rows: tuple[int, ...]  # per ubatch, identical to every peer's tile_rows
    receive_rows: tuple[int, ...]  # per ubatch, len(peers) * tile_rows
    mode: RunMode
    key: GraphKey | None
    # Expert parallelism (empty tuples without it): the FFN group's global ranks in group order,
    # and per ubatch the rows every member contributes to the group's exchange: its receive
    # rows, then pad rows (zero hidden states, no expert) up to the group's largest receive.
    group: tuple[int, ...] = ()
    group_rows: tuple[int, ...] = ()
    drafts: tuple[FFNRankPlan, ...] = ()  # the draft passes (plan.py, rule 9)

    def __post_init__(self) -> None:
        if list(self.peers) != sorted(set(self.peers)) or not (self.peers or self.group):
            raise ValueError(
                f"FFN rank {self.rank}: peers must be increasing and non-empty "
                f"outside an expert-parallel group, got {self.peers}"
            )
        if self.receive_rows != tuple(len(self.peers) * tile for tile in self.tile_rows):
            raise ValueError(f"FFN rank {self.rank}: receive_rows != peers x tile_rows: {self}")
        if self.group:
            if self.rank not in self.group or len(self.group_rows) != len(self.tile_rows):
                raise ValueError(
                    f"FFN rank {self.rank}: not in its group, or group_rows per "
                    f"ubatch missing: {self}"
                )
            if any(g < r for g, r in zip(self.group_rows, self.receive_rows, strict=True)):
                raise ValueError(f"FFN rank {self.rank}: group_rows < receive_rows: {self}")
        elif self.group_rows:
            raise ValueError(f"FFN rank {self.rank}: group_rows without a group: {self}")
        _check_mode_and_key(self.mode, self.key, self.rank)

    @property
    def exchange_rows(self) -> tuple[int, ...]:
        """Per ubatch, the rows this rank runs its FFN exchange over: its receive rows, or in an
        expert-parallel group the group's rows (a rank without peers still serves its experts)."""
        return self.group_rows if self.group else self.receive_rows

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
        **(
            {
                "draft_tiles": [list(d.tile_rows) for d in plan.drafts],
                "draft_modes": [d.mode for d in plan.drafts],
            }
            if plan.drafts
            else {}
        ),
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
        for plan in self.ffn:  # every peer writes exactly the rows its FFN rank reads
            for u in range(len(plan.tile_rows)):
                for peer, lo, hi in plan.peer_rows(u):
                    if peer < len(self.attention) and plan.mode != "idle":
                        theirs = self.attention[peer]
                        if theirs.ffn_rank == plan.rank and theirs.ffn_rows(u) != (lo, hi):
                            raise ValueError(
                                f"ubatch {u}: FFN rank {plan.rank} reads rows {lo}:{hi} of "
                                f"attention rank {peer}, which writes {theirs.ffn_rows(u)}"
                            )

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
        """Keys captured by this step, its draft passes' included; feed them to
        `GraphTable.with_captured` afterwards."""
        plans: tuple[AttentionRankPlan | FFNRankPlan, ...] = self.attention + self.ffn
        plans += tuple(draft for plan in plans for draft in plan.drafts)
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
            record = _record(step, "ffn", plan, sum(plan.receive_rows), list(plan.peers))
            if plan.group:
                record["group_rows"] = list(plan.group_rows)
            records.append(record)
        return records
