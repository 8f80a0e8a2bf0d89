"""Which global rank plays which role, and which attention ranks each FFN rank serves.

A topology `<A>A<F>F` has A attention ranks (global ranks [0, A)) and F FFN ranks (global ranks
[A, A + F)). FFN rank f serves the attention ranks r with r mod F == f (its *peers*), a strided
assignment that works whether or not F divides A. `colocated` means one attention rank and no FFN
ranks; `<A>A0F` is colocated data parallel (A replicas, each running its own FFN half).

With `expert_parallel` the F FFN ranks form one *expert-parallel group*: each holds a disjoint shard
of the routed experts (layout/experts.py), and every attention rank's tile reaches the whole group
through its home FFN rank (the same r mod F rule). A < F is allowed then: FFN ranks f >= A have no
attention peers and serve the group with their experts only.

Pure Python: the step planner and every role read this, so it must not depend on torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_PATTERN = re.compile(r"([0-9]+)A([0-9]+)F", re.IGNORECASE)
_ALLOWED = (
    "'colocated' or '<A>A<F>F' with A >= F >= 1 (e.g. '2A1F', '4A2F', '3A2F'), any A, F >= 1 "
    "with an expert-parallel FFN group (e.g. '1A2F', '2A4F'), or '<A>A0F' for colocated "
    "data parallel"
)


@dataclass(frozen=True)
class Topology:
    attention_ranks: int
    ffn_ranks: int
    expert_parallel: bool = False  # the FFN ranks shard the routed experts among themselves

    def __post_init__(self) -> None:
        for name in ("attention_ranks", "ffn_ranks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if not isinstance(self.expert_parallel, bool):
            raise ValueError(f"expert_parallel must be a bool, got {self.expert_parallel!r}")
        if self.attention_ranks < 1:
            raise ValueError(f"attention_ranks must be >= 1, got {self.attention_ranks}")
        if self.ffn_ranks < 0:
            raise ValueError(f"ffn_ranks must be >= 0 (0 = colocated), got {self.ffn_ranks}")
        if self.expert_parallel and self.ffn_ranks == 0:
            raise ValueError(
                "expert_parallel=True needs ffn_ranks >= 1: a colocated topology has no FFN "
                "ranks to shard experts across"
            )
        if self.ffn_ranks > self.attention_ranks and not self.expert_parallel:
            raise ValueError(
                f"ffn_ranks ({self.ffn_ranks}) must not exceed attention_ranks "
                f"({self.attention_ranks}): FFN rank f serves the attention ranks r with "
                f"r mod F == f, so every FFN rank needs at least one attention peer; A < F needs "
                f"an expert-parallel FFN group (ffn_expert_parallel=True, --ffn-expert-parallel)"
            )

    @classmethod
    def parse(cls, text: str, expert_parallel: bool = False) -> Topology:
        """Parse `colocated`, `2A1F`, `4a2f` (case-insensitive) or `2A0F`."""
        stripped = text.strip()
        if stripped.lower() == "colocated":
            if expert_parallel:
                raise ValueError(
                    f"topology {text!r}: an expert-parallel FFN group needs FFN ranks; "
                    f"allowed: {_ALLOWED}"
                )
            return cls(attention_ranks=1, ffn_ranks=0)
        match = _PATTERN.fullmatch(stripped)
        if match is None:
            raise ValueError(f"topology {text!r} is not understood; allowed: {_ALLOWED}")
        try:
            return cls(int(match[1]), int(match[2]), expert_parallel)
        except ValueError as error:
            raise ValueError(f"topology {text!r}: {error}; allowed: {_ALLOWED}") from None

    @property
    def colocated(self) -> bool:
        return self.ffn_ranks == 0

    @property
    def world_size(self) -> int:
        return self.attention_ranks + self.ffn_ranks

    def is_attention(self, rank: int) -> bool:
        self._check_global(rank)
        return rank < self.attention_ranks

    def ffn_index(self, rank: int) -> int:
        """Global FFN rank -> its index f in [0, F)."""
        if not self.attention_ranks <= rank < self.world_size:
            raise ValueError(
                f"rank {rank} is not an FFN rank of {self}; FFN ranks are "
                f"[{self.attention_ranks}, {self.world_size})"
            )
        return rank - self.attention_ranks

    def ffn_rank_of(self, attention_rank: int) -> int | None:
        """Global rank of the FFN rank serving `attention_rank`; None when colocated."""
        if not 0 <= attention_rank < self.attention_ranks:
            raise ValueError(
                f"attention_rank {attention_rank} is out of range for {self}; "
                f"attention ranks are [0, {self.attention_ranks})"
            )
        if self.colocated:
            return None
        return self.attention_ranks + attention_rank % self.ffn_ranks

    @property
    def ffn_group(self) -> tuple[int, ...]:
        """Global ranks of the expert-parallel FFN group, in group order; () without one."""
        if not self.expert_parallel:
            return ()
        return tuple(range(self.attention_ranks, self.world_size))

    def peers(self, f: int) -> tuple[int, ...]:
        """Attention ranks served by FFN index f, in increasing order (empty for f >= A, which
        only an expert-parallel group allows)."""
        if not 0 <= f < self.ffn_ranks:
            raise ValueError(
                f"FFN index {f} is out of range for {self}; allowed [0, {self.ffn_ranks})"
            )
        return tuple(range(f, self.attention_ranks, self.ffn_ranks))

    def _check_global(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank {rank} is out of range for {self}; allowed [0, {self.world_size})"
            )

    def __str__(self) -> str:
        if self.attention_ranks == 1 and self.ffn_ranks == 0:
            return "colocated"
        # The spelling stays parseable; expert parallelism is a flag beside it (repr shows it).
        return f"{self.attention_ranks}A{self.ffn_ranks}F"
