"""Expert placement of an expert-parallel FFN group: which FFN rank holds which routed experts.

A placement is one tuple of expert ids per FFN index f (in group order), each sorted; together they
hold every expert exactly once. The same placement holds for every MoE layer. By default the
experts are cut into contiguous near-equal shards (f holds a run of E / F experts, the first
E mod F ranks one more); a user table can place them otherwise (for instance to balance hot
experts), and is checked here before any process starts.

Pure Python: the config, the loader and the FFN ranks all read this, so it must not import torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

Placement = tuple[tuple[int, ...], ...]


def contiguous_placement(num_experts: int, ffn_ranks: int) -> Placement:
    """Contiguous near-equal shards: rank f holds a run of experts, the first E mod F one more."""
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    if not isinstance(ffn_ranks, int) or ffn_ranks < 1:
        raise ValueError(f"ffn_ranks must be an int >= 1, got {ffn_ranks!r}")
    base, extra = divmod(num_experts, ffn_ranks)
    shards, start = [], 0
    for f in range(ffn_ranks):
        size = base + (1 if f < extra else 0)
        shards.append(tuple(range(start, start + size)))
        start += size
    return tuple(shards)


def check_placement_shape(table: object, ffn_ranks: int) -> Placement:
    """The checks that need no model: one list of non-negative int expert ids per FFN rank, no
    expert twice. Returns the table as sorted tuples."""
    if not isinstance(table, Sequence) or isinstance(table, str) or len(table) != ffn_ranks:
        raise ValueError(
            f"expert_placement={table!r} is not allowed: one list of expert ids per FFN rank "
            f"({ffn_ranks} lists, FFN index order)"
        )
    shards = []
    for f, shard in enumerate(table):
        if (
            not isinstance(shard, Sequence)
            or isinstance(shard, str)
            or not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in shard)
        ):
            raise ValueError(
                f"expert_placement[{f}]={shard!r} is not allowed: a list of expert ids "
                f"(integers >= 0)"
            )
        shards.append(tuple(sorted(shard)))
    counts = Counter(e for shard in shards for e in shard)
    twice = sorted(e for e, n in counts.items() if n > 1)
    if twice:
        where = {e: [f for f, shard in enumerate(shards) if e in shard] for e in twice[:8]}
        raise ValueError(
            f"expert_placement places experts more than once (expert: FFN indices): {where}; "
            f"every expert must be held by exactly one FFN rank"
        )
    return tuple(shards)


def resolve_placement(table: object | None, num_experts: int, ffn_ranks: int) -> Placement:
    """The placement the FFN group uses: the user's table (checked against the model's expert
    count) or contiguous shards."""
    if table is None:
        return contiguous_placement(num_experts, ffn_ranks)
    shards = check_placement_shape(table, ffn_ranks)
    held = {e for shard in shards for e in shard}
    outside = sorted(e for e in held if e >= num_experts)
    missing = sorted(set(range(num_experts)) - held)
    if outside or missing:
        problems = []
        if missing:
            problems.append(f"experts held by no FFN rank: {missing[:16]}")
        if outside:
            problems.append(f"expert ids outside [0, {num_experts}): {outside[:16]}")
        raise ValueError(
            f"expert_placement does not fit a model with {num_experts} routed experts: "
            f"{'; '.join(problems)}; every expert must be held by exactly one FFN rank"
        )
    return shards
