"""The types every attention implementation reads (the reference kernels and the Triton fast
paths alike): a step batch's rows per sequence (`Segment`, and `BatchedSegments` on the device),
the step's `AttentionMetadata`, and how GQA's packed projection splits (`QKVLayout`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Segment:
    """Consecutive rows of one sequence in a step batch: rows [row_start, row_end) hold the
    positions [context_len - (row_end - row_start), context_len) of that sequence."""

    row_start: int
    row_end: int
    block_table: torch.Tensor  # [max_blocks] int32/int64 on the cache device
    context_len: int
    # The sequence's slot of the cache's per-sequence state (model/cache.py's SequenceSlots);
    # -1 where the cache keeps none.
    state_slot: int = -1

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start


@dataclass(frozen=True)
class BatchedSegments:
    """The segments as device tensors, for kernels that handle the whole batch in one launch."""

    query_start: torch.Tensor  # [n + 1] int32, row offsets of each segment
    context_lens: torch.Tensor  # [n] int32
    block_tables: torch.Tensor  # [n, max_blocks] int32
    max_query_len: int
    max_context_len: int
    # [n] int32, each segment's state slot (-1: none); None where no segment has one.
    state_slots: torch.Tensor | None = None


def batch_segments(segments: tuple[Segment, ...], device: torch.device) -> BatchedSegments:
    starts = [seg.row_start for seg in segments] + [segments[-1].row_end if segments else 0]
    tables = (
        torch.stack([seg.block_table for seg in segments]).to(torch.int32)
        if segments
        else torch.zeros(0, 1, dtype=torch.int32, device=device)
    )
    return BatchedSegments(
        query_start=torch.tensor(starts, dtype=torch.int32).to(device),
        context_lens=torch.tensor([s.context_len for s in segments], dtype=torch.int32).to(device),
        block_tables=tables,
        max_query_len=max((s.num_rows for s in segments), default=0),
        max_context_len=max((s.context_len for s in segments), default=0),
        state_slots=_state_slots(segments, device),
    )


def _state_slots(segments: tuple[Segment, ...], device: torch.device) -> torch.Tensor | None:
    """The segments' state slots, or None where the cache keeps no state per sequence (no
    copy to the device for the other families)."""
    slots = [s.state_slot for s in segments]
    if not keeps_state(slots):
        return None
    return torch.tensor(slots, dtype=torch.int32).to(device)


def keeps_state(slots: list[int]) -> bool:
    """Whether a step's segments have state slots to send (-1: none): a cache without
    per-sequence state sends none."""
    return any(slot >= 0 for slot in slots)


@dataclass(frozen=True)
class AttentionMetadata:
    positions: torch.Tensor  # [rows] int64
    slot_mapping: torch.Tensor  # [rows] int64, -1 for pad rows
    segments: tuple[Segment, ...]
    batched: BatchedSegments | None = None
    # The same rows as the windowed layers see them: their own pool's slots and block tables
    # (model/cache.py's `CacheSpec.window`); None where they share this view's.
    window: AttentionMetadata | None = None
    # What the cache's specs build of this ubatch for their layers, once per ubatch from
    # `batched` (model/cache.py's `CacheSpec.step_metadata`): each layer picks its own by type.
    step: tuple[Any, ...] = ()

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])

    def rows(self, start: int, end: int) -> AttentionMetadata:
        """The metadata of rows [start, end) alone (a ubatch). A sequence cut by the boundary keeps
        its part; its earlier rows' KV is written by the earlier ubatch before this one runs."""
        if start == 0 and end == self.num_rows:
            return self
        window = None if self.window is None else self.window.rows(start, end)
        segments = []
        for seg in self.segments:
            lo, hi = max(seg.row_start, start), min(seg.row_end, end)
            if lo >= hi:
                continue
            context = seg.context_len - (seg.row_end - hi)
            segments.append(
                Segment(lo - start, hi - start, seg.block_table, context, seg.state_slot)
            )
        segments = tuple(segments)
        batched = None
        if self.batched is not None:
            batched = batch_segments(segments, self.positions.device)
        return AttentionMetadata(
            self.positions[start:end], self.slot_mapping[start:end], segments, batched, window
        )


@dataclass(frozen=True)
class QKVLayout:
    """How GQA's packed projection [rows, (heads + 2 kv_heads) * head_dim] splits into heads, and
    what its prologue applies: q/k norms (both or neither), per head (Qwen3: weights [head_dim])
    or, with `norm_over_heads`, over each row's whole q and k (MiniMax-M2: weights [heads *
    head_dim] and [kv_heads * head_dim]); the rotary's pairing, over each head's first
    `rotary_dim` channels (None: all of them; the rest pass through, MiniMax-M2's partial rope)."""

    heads: int
    kv_heads: int
    head_dim: int
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float
    interleave: bool
    norm_over_heads: bool = False
    rotary_dim: int | None = None

    def __post_init__(self) -> None:
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("q_norm and k_norm come together: give both or neither")
        rot = self.rotary_width
        if rot <= 0 or rot % 2 or rot > self.head_dim:
            raise ValueError(
                f"rotary_dim={self.rotary_dim}: an even width in (0, head_dim={self.head_dim}]"
            )

    @property
    def rotary_width(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim
