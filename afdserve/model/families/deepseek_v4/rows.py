"""One ubatch's rows as DeepSeek-V4's batched layers read them (batched.py), and DSA's indexer
too: each row's position, its segment's block table and chunk bounds, from the device segments
alone (no host sync). Built once per ubatch (`V4Pages.step_metadata`) and shared by every layer,
with what the layers derive from the rows alone (page addresses, rotary tables: `shared`), so
a decode layer launches none of that arithmetic again."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from afdserve.kernels import ops
from afdserve.kernels.metadata import AttentionMetadata, BatchedSegments

T = TypeVar("T")


@dataclass(frozen=True)
class StepRows:
    """One ubatch's rows on the device, each with its segment's table and chunk bounds."""

    positions: torch.Tensor  # [rows] int64
    tables: torch.Tensor  # [rows, W] int64, W = the block table width (max blocks per sequence)
    real: torch.Tensor  # [rows] bool: in a segment of context > 0
    start: torch.Tensor  # [rows] int64: the first position of the row's chunk
    end: torch.Tensor  # [rows] int64: the chunk's end, its segment's context length
    decode: bool = False  # every segment one row (known on the host: what a graph captures)
    # [rows] int64: the segment's state slot, where its open compressor rows sit (-1: pad rows).
    slots: torch.Tensor | None = None
    # [rows, W] int64: the segment's window table, which addresses the window's rows (None:
    # `tables` does).
    window_tables: torch.Tensor | None = None
    # What the layers derive from these rows alone (`shared`). Not an init field, so
    # dataclasses.replace starts a new one: a replaced row set is another row set.
    memo: dict[Hashable, Any] = field(default_factory=dict, init=False, compare=False, repr=False)

    @classmethod
    def of(
        cls, meta: AttentionMetadata, window: AttentionMetadata | None = None
    ) -> StepRows | None:
        """The rows of `meta`, or None when it carries no device segments (`batched`);
        `window`: the same rows through the window pool's tables (None: `meta`'s)."""
        batched = meta.batched
        if batched is None:
            return None
        slots = batched.state_slots
        if slots is None and batched.context_lens.numel() == 0:  # pad rows only
            slots = batched.context_lens
        window_tables = None
        if window is not None and window is not meta:
            window_tables = window.batched.block_tables
        fused = ops.step_rows(batched, meta.num_rows, slots, window_tables)
        if fused is None:
            fused = _rows_torch(batched, meta.num_rows, slots, window_tables)
        tables, real, start, end, slots, window_tables = fused
        decode = batched.max_query_len <= 1
        return cls(meta.positions.long(), tables, real, start, end, decode, slots, window_tables)

    @classmethod
    def of_ubatch(cls, meta: AttentionMetadata) -> StepRows | None:
        """The rows of a ubatch's metadata, its window pool's tables where it has them: what
        the cache specs build as step metadata and `find` builds from bare metadata."""
        return cls.of(meta, meta.window or meta)

    @classmethod
    def find(cls, meta: AttentionMetadata) -> StepRows | None:
        """The ubatch's rows as the engine built them once for all its layers
        (`CacheLayout.with_step_metadata`), or built here from bare metadata (a test, a bench);
        None without device segments."""
        built = next((s for s in meta.step if isinstance(s, cls)), None)
        return built if built is not None else cls.of_ubatch(meta)

    def shared(self, key: Hashable, build: Callable[[], T]) -> T:
        """`build()`, made by the first layer of the ubatch that asks by `key` and handed to the
        others: for what depends on the rows and a layout alone (a page layout's addresses are
        keyed by `LayerPages.layout`), never on a layer's weights or activations. Under a CUDA
        graph the first layer's capture holds the ops and every replay reruns them."""
        if key not in self.memo:
            self.memo[key] = build()
        return self.memo[key]

    def rotary(self, rope: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope.at` the rows' positions (a RopeTable: the model holds one per base and
        device, so its identity names it within the ubatch)."""
        return self.shared(("rotary", id(rope)), lambda: rope.at(self.positions))

    @property
    def windows(self) -> torch.Tensor:
        """[rows, W] the tables that address each row's window rows."""
        return self.tables if self.window_tables is None else self.window_tables

    def state_slots(self) -> torch.Tensor:
        """[rows] the state slots, which a compressed layer's open rows need."""
        if self.slots is None:
            raise ValueError("StepRows.slots is None: compressed layers keep open rows in slots")
        return self.slots

    def chunk_or(
        self, values: torch.Tensor, positions: torch.Tensor, cached: torch.Tensor
    ) -> torch.Tensor:
        """What each row sees at `positions` [rows, n]: the chunk's own rows' `values` [rows,
        width] where a position is at or past the chunk's start, `cached` [rows, n, width]
        before it -> [rows, n, width], in values' dtype. Positions past a row's own read a
        clamped row (kept only where masked)."""
        rows = values.shape[0]
        row = torch.arange(rows, device=values.device)
        source = (row[:, None] - (self.positions[:, None] - positions)).clamp(0, rows - 1)
        own = (positions >= self.start[:, None])[..., None]
        return torch.where(own, values[source], cached.to(values.dtype))


def _rows_torch(
    batched: BatchedSegments,
    rows: int,
    slots: torch.Tensor | None,
    window_tables: torch.Tensor | None,
) -> tuple[torch.Tensor | None, ...]:
    """`ops.step_rows`' fields in torch ops (off CUDA): (tables, real, start, end, slots,
    window tables) of each row."""
    query_start = batched.query_start.long()
    row = torch.arange(rows, device=query_start.device)
    # Row r is in segment i when query_start[i] <= r < query_start[i + 1]; rows past the last
    # segment get index n, the pad segment appended here (no rows, context 0).
    segment = torch.searchsorted(query_start[1:], row, right=True)
    context = F.pad(batched.context_lens.long(), (0, 1))[segment]
    count = F.pad(query_start[1:] - query_start[:-1], (0, 1))[segment]
    tables = F.pad(batched.block_tables.long(), (0, 0, 0, 1))[segment]
    if window_tables is not None:
        window_tables = F.pad(window_tables.long(), (0, 0, 0, 1))[segment]
    if slots is not None:
        slots = F.pad(slots.long(), (0, 1), value=-1)[segment]
    return tables, context > 0, context - count, context, slots, window_tables
