"""DeepSeek-V4's KV cache: every layer's state in pages of the engine's blocks, its sliding
window's rows in the engine's window pool, and the compressors' open rows in one slot per
sequence.

The engine gives each sequence one block table, as for every family (block b of the table covers
positions [b B, (b + 1) B), B = block_size), a window table over the window pool (`V4Window`:
its blocks behind the window are freed) and one state slot. A V4 layer keeps, per physical
block, pages of its own geometry (`LayerGeometry` lists them), each page addressed by position;
what does not grow with the context, the rows of the window its compressor has not pooled yet, sits
in the sequence's slot (a ring of R rows at their positions, `LayerGeometry.ring`, with room for a
speculative step's rejected rows). So any chunking works (a chunk reads the state its start needs
and writes what its end leaves), a rolled-back step resumes at any position it wrote, and preemption
by recompute rewrites it from position 0. A chunk also writes the state each block it completes
leaves at its end (boundary writes), so a full block resumes a chunk starting there: prefix caching
reuses it where B is a multiple of every compress rate, where a block boundary leaves no open row
(the slot holds nothing a resumed chunk reads).

`read` turns pages and slot into the per-sequence `LayerState` that `V4Attention` consumes, and
`write` stores the state after a chunk back: the attention itself is the one the model tests hold
equal to transformers' full forward. An FP8 cache stores the KV pages as float8_e4m3fn.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from afdserve.kernels import ops
from afdserve.kernels.metadata import AttentionMetadata
from afdserve.model.cache import CacheLayout, CacheSpec
from afdserve.model.config import ModelConfig
from afdserve.model.families.deepseek_v4.attention import CompressorState, LayerState
from afdserve.model.families.deepseek_v4.geometry import MAX_DRAFT_ROWS, LayerGeometry
from afdserve.model.families.deepseek_v4.rows import StepRows

_SHORT = {
    "sliding_attention": "sliding",
    "compressed_sparse_attention": "CSA",
    "heavily_compressed_attention": "HCA",
}


# Why V4's pages refuse what a plain paged cache allows (model/cache.py reads these).
# `full` captures prefill chunks beside decodes (batched.py's step, from the graph's static
# buffers): with Triton each row reads its compressed entries only up to its own position
# (kernels/triton/v4_attention.py's EVERY, v4_index_select.py); without it the torch form
# gathers every row's entries out to max_model_len, rows x context in one captured step.
FULL_GRAPH_REFUSAL = (
    "without Triton its captured prefill and mixed steps would gather every row's compressed "
    "keys out to max_model_len (rows x context); install Triton, or use "
    "graph_mode='full_decode_only' or 'none'"
)
# Graphs by default up to the longest context measured to win (docs/benchmarks.md, "DeepSeek-V4
# served"), measured when a captured decode step read every row's compressed entries out to
# max_model_len; it now reads them up to each row's position (a scratch of the indexer's
# scores still spans max_model_len), so the limit is a measured floor, not a bound.
GRAPH_CONTEXT_LIMIT = (
    65536,
    "DeepSeek-V4's graphs were measured to beat eager steps up to max_model_len 65536 "
    "(docs/benchmarks.md); pass graph_mode='full_decode_only' for them at longer contexts",
)


# Speculative steps write rows past what a sequence keeps; the pages hold every row at its own
# position and the slot rings hold MAX_DRAFT_ROWS beside what a rollback returns to.
DRAFT_LIMIT = (
    MAX_DRAFT_ROWS,
    "DeepSeek-V4's compressor rings keep the open window's rows at their positions with room "
    f"for {MAX_DRAFT_ROWS} draft rows past a sequence's end (LayerGeometry.ring)",
)


@dataclass(frozen=True)
class V4Pages(CacheSpec):
    """The layers of one attention type, each a `LayerPages` over the engine's blocks."""

    attention_type: str
    layers: tuple[int, ...]
    config: ModelConfig
    graph_context_limit = GRAPH_CONTEXT_LIMIT
    # Decode ubatches run batched from device segments on every device (batched.py), so CPU
    # runs what a graph captures.
    batched_segments = True

    @property
    def kind(self) -> str:
        return _SHORT[self.attention_type]

    @property
    def graph_refusals(self) -> tuple[tuple[str, str], ...]:
        """`full` where the fused kernels run (FULL_GRAPH_REFUSAL says why not elsewhere)."""
        return () if ops.triton_available() else (("full", FULL_GRAPH_REFUSAL),)

    draft_limit = DRAFT_LIMIT
    # Every V4 layer reads a ubatch's rows alike: one StepRows for all three attention types.
    step_metadata_per_type = True

    def step_metadata(self, meta: AttentionMetadata) -> StepRows | None:
        return StepRows.of_ubatch(meta)

    def prefix_reuse_refusal(self, block_size: int) -> str | None:
        if self.geometry(block_size).resumable:
            return None
        v4 = self.config.family_config
        rates = {_SHORT[t]: v4.compress_rate(i) for i, t in enumerate(v4.attention_types)}
        named = ", ".join(f"{kind} {rate}" for kind, rate in rates.items() if rate)
        lcm = math.lcm(*(rate for rate in rates.values() if rate))
        return (
            f"block_size={block_size} is not a multiple of every compress rate ({named}), so a "
            "block would end inside a compressor window, whose open rows live in the "
            f"sequence's state slot, not in the block; use a block_size that is a multiple of {lcm}"
        )

    def geometry(self, block_size: int) -> LayerGeometry:
        return LayerGeometry.of(self.config, self.layers[0], block_size)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return self.geometry(block_size).bytes_per_block(dtype, window=False)

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        # The open rings do not depend on the block size.
        return self.geometry(1).bytes_per_slot(dtype)

    def allocate(self, num_blocks, block_size, dtype, device, num_slots: int = 0):
        if num_slots < 1 and self.bytes_per_slot(dtype):
            raise ValueError(
                f"num_slots={num_slots}: {self.kind} layers keep their open compressor rows in "
                "a slot per sequence; give >= 1"
            )
        geometry = self.geometry(block_size)
        return [
            LayerPages(geometry, num_blocks, dtype, device, num_slots, window=False)
            for _ in self.layers
        ]

    def join(self, layer_cache: LayerPages, window_cache: LayerPages) -> LayerPages:
        return layer_cache.join(window_cache)

    @staticmethod
    def tensors(layer_cache: LayerPages):
        yield from layer_cache.pages.values()
        yield from layer_cache.slots.values()


@dataclass(frozen=True)
class V4Window(CacheSpec):
    """The window-pool pages of the layers of one attention type (`LayerGeometry`'s
    `pooled` ones: the sliding window's rows, and a CSA layer's first series of the window
    ending each block): a query at p reads p - window < j <= p and a chunk resuming at p the
    series of the window ending there, so the blocks behind the window are freed. Each
    layer's `V4Pages` joins them to its other pages (`LayerPages.join`)."""

    attention_type: str
    layers: tuple[int, ...]
    config: ModelConfig
    window: int | None = None

    @property
    def kind(self) -> str:
        return f"{_SHORT[self.attention_type]} window"

    def geometry(self, block_size: int) -> LayerGeometry:
        return LayerGeometry.of(self.config, self.layers[0], block_size)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return self.geometry(block_size).bytes_per_block(dtype, window=True)

    def allocate(self, num_blocks, block_size, dtype, device):
        geometry = self.geometry(block_size)
        return [LayerPages(geometry, num_blocks, dtype, device, window=True) for _ in self.layers]


def cache_layout(config: ModelConfig) -> CacheLayout:
    """Per attention type, in the order the types first appear, its pages and (after them all)
    its window-pool pages."""
    types = config.family_config.attention_types
    groups: dict[str, list[int]] = {}
    for i, kind in enumerate(types):
        groups.setdefault(kind, []).append(i)
    window = config.family_config.sliding_window
    pages = [V4Pages(kind, tuple(layers), config) for kind, layers in groups.items()]
    windows = [V4Window(kind, tuple(layers), config, window) for kind, layers in groups.items()]
    return CacheLayout((*pages, *windows), config.num_layers)


class LayerPages:
    """One layer's pages over every block of the cache, and its open rows over every sequence slot
    (`slots`: [num_slots, R, width] per ring, `LayerGeometry.ring`). An FP8 cache
    (kv_cache_dtype="fp8") holds the unrotated channels of its "kv" pages as float8_e4m3fn at
    `scale` (1.0, as the other families' k_scale: vLLM's default, model/layers/attention.py) and
    their rotated ones as bf16 (`LayerGeometry.stored`): writes quantize, reads dequantize, and
    `as_stored` gives a chunk's own keys as the pages would, so every key a query reads has passed
    through the cache whichever chunk wrote it: on a bf16 model (whose compressor state the bf16
    pages hold exactly) any chunking, prefix hits included, reads the same keys."""

    def __init__(
        self,
        geometry: LayerGeometry,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_slots: int = 0,
        window: bool | None = None,
    ) -> None:
        """`window`: the window's pages alone (True: the window pool's part), the others
        (False: the main pages' and the slot's, `join` adds the window's), or all (None)."""
        self.geometry = geometry
        self.scale = 1.0
        self.fp8 = dtype == ops.FP8_DTYPE
        # Each page is [num_blocks, rows, width] and each ring [num_slots, R, width] over a flat
        # buffer one row longer: that last row (`scratch`) is where the batched path (batched.py)
        # sends the writes of pad rows, so they never land in a real sequence's state. It
        # belongs to no block or slot and is never read as state; `bytes` counts pages and
        # rings only. CSA's first series may have both (`_prev_rows`): one buffer, pages first
        # (the window pool's, `join`).
        pages = {
            name: (rows, width, d)
            for name, rows, width, d in geometry.stored(dtype)
            if window is None or geometry.pooled(name) == window
        }
        stored = geometry.stored(dtype, True) if not window else []
        rings = {name: (rows, width, d) for name, rows, width, d in stored}
        self.flat, self.pages, self.slots = {}, {}, {}
        self.ring_base: dict[str, int] = {}  # the flat row of each ring's slot 0
        for name in (*pages, *(name for name in rings if name not in pages)):
            page_rows, width, page_dtype = pages[name] if name in pages else (0, *rings[name][1:])
            ring_rows = rings[name][0] if name in rings else 0
            base = num_blocks * page_rows
            flat = torch.zeros(
                base + num_slots * ring_rows + 1, width, device=device, dtype=page_dtype
            )
            self.flat[name] = flat
            if name in pages:
                self.pages[name] = flat[:base].view(num_blocks, page_rows, width)
            if name in rings:
                self.ring_base[name] = base
                self.slots[name] = flat[base:-1].view(num_slots, ring_rows, width)

    def join(self, window: LayerPages) -> LayerPages:
        """These pages with `window`'s (the window pool's part of the same layer). CSA's first
        series keep one flat buffer, the window pool's pages then the slots' rings (the fused
        decode compressor addresses both in one tensor): joined into a new one."""
        for name, flat in window.flat.items():
            if name in self.slots:
                pages, rings = window.pages[name], self.slots[name]
                base = pages.shape[0] * pages.shape[1]
                flat = torch.cat((flat[:-1], self.flat[name]))  # ours ends with the scratch row
                self.slots[name] = flat[base:-1].view(rings.shape)
                self.ring_base[name] = base
            self.flat[name] = flat
            if name in window.pages:
                self.pages[name] = flat[: window.pages[name].numel() // flat.shape[-1]].view(
                    window.pages[name].shape
                )
        return self

    @property
    def layout(self) -> Hashable:
        """What a flat row's address depends on besides the rows: the geometry and each flat
        buffer's length and ring base. Equal for every layer of one spec (allocated alike, joined
        to alike window pages), so a ubatch's addresses are made once for all of them
        (`StepRows.shared`)."""
        flat = tuple((n, f.shape[0], self.ring_base.get(n, -1)) for n, f in self.flat.items())
        return (self.geometry, flat)

    @property
    def bytes(self) -> int:
        held = (*self.pages.values(), *self.slots.values())
        return sum(t.numel() * t.element_size() for t in held)

    def as_stored(self, values: torch.Tensor) -> torch.Tensor:
        """Keys or entries [..., width] as a "kv" page gives them back (FP8: the round trip of
        both parts; else unchanged)."""
        if not self.fp8:
            return values
        cut = values.shape[-1] - self.geometry.rope
        nope = ops.quantize_kv(values[..., :cut], ops.FP8_DTYPE, self.scale)
        return torch.cat(
            (
                ops.dequantize_kv(nope, self.scale, values.dtype),
                values[..., cut:].to(torch.bfloat16).to(values.dtype),
            ),
            dim=-1,
        )

    def _load(self, name: str, rows: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        """Flat rows of page `name` in the reader's `dtype` (None: bf16 where FP8, else as
        stored); float32 pages stay float32."""
        page = self.flat[name]
        values = self._bytes(page)[rows].view(page.dtype)
        if values.dtype == torch.float32:
            return values
        dtype = dtype or (torch.bfloat16 if self.fp8 else values.dtype)
        if f"{name}_rope" not in self.flat:
            return values.to(dtype)
        rope = self.flat[f"{name}_rope"][rows]
        return torch.cat((ops.dequantize_kv(values, self.scale, dtype), rope.to(dtype)), dim=-1)

    @staticmethod
    def _bytes(page: torch.Tensor) -> torch.Tensor:
        """An e4m3 page as bytes: indexing kernels take uint8 on every device and torch
        version, float8 not everywhere."""
        return page.view(torch.uint8) if page.dtype == ops.FP8_DTYPE else page

    def _save(self, name: str, rows: torch.Tensor, values: torch.Tensor) -> None:
        """values [n, width] into flat rows [n] of page `name` (quantized where FP8)."""
        flat = self.flat[name]
        if f"{name}_rope" not in self.flat:
            flat[rows] = values.to(flat.dtype)
            return
        cut = flat.shape[-1]
        stored = ops.quantize_kv(values[..., :cut], flat.dtype, self.scale)
        self._bytes(flat)[rows] = self._bytes(stored)
        self.flat[f"{name}_rope"][rows] = values[..., cut:].to(torch.bfloat16)

    # ----- addressing: positions or entries -> rows of a page flattened to [blocks * rows] -----
    # One sequence: table [max_blocks], positions/entries [n]; a batch (batched.py): table
    # [rows, max_blocks], positions/entries [rows, n], each row through its own table.
    @staticmethod
    def _block(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return table[index] if table.dim() == 1 else table.gather(1, index)

    def _rows_of(self, name: str, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rows = self.pages[name].shape[1]
        block = self._block(table, positions // self.geometry.block_size)
        return block * rows + positions % rows

    def _open_rows(
        self, slot: torch.Tensor | int, positions: torch.Tensor, name: str = "open_kv"
    ) -> torch.Tensor:
        """Flat rows of ring `name` (the open rows: every compressor's alike) for `positions` of
        the sequence in `slot` (one sequence: an int; a batch: [rows], positions [rows, n]):
        position p at row p % R (`LayerGeometry.ring`). Slot -1 (a pad row) reads slot 0's
        rows (always masked) and writes nowhere (`store` sends them to the scratch row)."""
        ring = self.geometry.ring
        if isinstance(slot, torch.Tensor):
            slot = slot.clamp(min=0)[:, None]
        return self.ring_base[name] + slot * ring + positions % ring

    def _in_page(self, positions: torch.Tensor) -> torch.Tensor | bool:
        """Whether the window of `positions` ends at a block end where B resumes prefixes: its
        first series is then kept in the pages (a block's end state), else in the slot."""
        g = self.geometry
        if g.prev_in_slot:
            return False
        return (positions // g.rate + 1) * g.rate % g.block_size == 0

    def _prev_rows(
        self,
        tables: tuple[torch.Tensor, torch.Tensor],
        slot: torch.Tensor | int,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """Flat rows of CSA's first series (`prev_*`, every compressor's alike) for positions of
        one window each: in the window's block where it ends a block (`_in_page`; a block of
        the window pool, `table` the window table: a prefix hit there needs that block
        cached), in the sequence's slot otherwise. Only the last window a chunk closes goes to
        the slot, so its ring holds the one the next chunk reads. `tables`: the main and the
        window tables (the pages' pool's addresses them: `LayerGeometry.pooled`)."""
        table = tables[1] if self.geometry.pooled("prev_kv") else tables[0]
        ring = self._open_rows(slot, positions, "prev_kv")
        in_page = self._in_page(positions)
        if in_page is False:
            return ring
        if table.dim() == 2:  # a ubatch: clamped as batch_rows
            positions = positions.clamp(0, table.shape[1] * self.geometry.block_size - 1)
        return torch.where(in_page, self._rows_of("prev_kv", table, positions), ring)

    def _entry_rows(self, name: str, table: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        bs, m, slots = self.geometry.block_size, self.geometry.rate, self.pages[name].shape[1]
        block = entries * m // bs
        first = (block * bs + m - 1) // m  # the block's first entry
        return self._block(table, block) * slots + entries - first

    # ----- a ubatch (batched.py): tables [rows, W], positions/entries [rows, n] -----
    def batch_rows(self, name: str, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat rows of `positions`, clamped into the W * B positions the tables address (a
        clamped read is always masked, a clamped write never kept)."""
        span = tables.shape[1] * self.geometry.block_size
        return self._rows_of(name, tables, positions.clamp(0, span - 1))

    def batch_window_rows(
        self, tables: torch.Tensor, positions: torch.Tensor, window: int
    ) -> torch.Tensor:
        """[rows, window] the flat window-page rows of positions p, p - 1, .. p - window + 1 of
        each row (positions [rows]): `batch_rows`, in one launch on CUDA."""
        page_rows = self.pages["window"].shape[1]
        block = self.geometry.block_size
        fused = ops.window_rows(positions, tables, window, block, page_rows)
        if fused is not None:
            return fused
        back = positions[:, None] - torch.arange(window, device=positions.device)
        return self.batch_rows("window", tables, back)

    def batch_open_rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat rows of the open rings: slots [rows] (-1: a pad row), positions [rows, n]."""
        return self._open_rows(slots, positions)

    def batch_prev_rows(
        self,
        tables: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """Flat rows of CSA's first series (`_prev_rows`) of each row's windows [rows, n];
        `tables`: the main and the window tables [rows, W]."""
        return self._prev_rows(tables, slots, positions)

    def keeps_prev_in_page(self, window_end: torch.Tensor) -> torch.Tensor | bool:
        """[rows] whether a window ending at `window_end` keeps its first series in the pages."""
        return self._in_page(window_end - 1)

    def fused_compress_addresses(
        self, entries: str, rows: StepRows, m: int, overlap: bool
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None] | None:
        """batched.py's `_compress_addresses` of `rows` in one launch where the
        kernels run (ops.v4_compress_addresses), else None: (addresses, entry rows, the chunk's
        (keep first series, keep open rows) or None for decode)."""
        g = self.geometry
        prev_rows = self.pages["prev_kv"].shape[1] if "prev_kv" in self.pages else 1
        return ops.v4_compress_addresses(
            rows.positions,
            rows.state_slots(),
            rows.tables,
            rows.windows,
            rows.end,
            rows.real,
            (m, g.ring, g.block_size, self.pages[entries].shape[1], prev_rows),
            (self.ring_base["open_kv"], self.ring_base.get("prev_kv", 0)),
            overlap,
            not rows.decode,
            (g.prev_in_slot, g.pooled("prev_kv")),
        )

    def batch_entry_rows(
        self, name: str, tables: torch.Tensor, entries: torch.Tensor
    ) -> torch.Tensor:
        count = -(-tables.shape[1] * self.geometry.block_size // self.geometry.rate)
        return self._entry_rows(name, tables, entries.clamp(0, count - 1))

    def take(self, name: str, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """flat rows [rows, n] -> [rows, n, width], in `dtype` (`_load`)."""
        return self._load(name, rows, dtype)

    def store(
        self, name: str, rows: torch.Tensor, values: torch.Tensor, keep: torch.Tensor
    ) -> None:
        """values [rows, n, width] to flat rows [rows, n] where `keep` [rows, n], the others to
        the scratch row: one masked scatter, no host sync."""
        rows = torch.where(keep, rows, self.flat[name].shape[0] - 1)
        self._save(name, rows.reshape(-1), values.reshape(-1, values.shape[-1]))

    def _span(self, lo: int, hi: int, device: torch.device) -> torch.Tensor:
        return torch.arange(max(lo, 0), hi, device=device)

    # ----- the per-sequence state -----
    def read(
        self,
        table: torch.Tensor,
        start: int,
        dtype: torch.dtype | None = None,
        slot: int = -1,
        window_table: torch.Tensor | None = None,
    ) -> LayerState | None:
        """The state a chunk starting at position `start` needs (None at position 0), in the
        reader's `dtype` (`_load`; the first series' gates stay float32); `slot`: the
        sequence's, needed only where `start` is inside a compressor window; `window_table`:
        the sequence's window table, which addresses the window's rows (None: `table`)."""
        if start == 0:
            return None
        g, dev = self.geometry, table.device
        window = self._span(start - (g.window - 1), start, dev)
        tables = (table, table if window_table is None else window_table)
        state = LayerState(
            self._load("window", self._rows_of("window", tables[1], window), dtype), window
        )
        if g.rate:
            state.compressor = self._read_compressor("", tables, start, dtype, slot)
            if g.kind == "compressed_sparse_attention":
                state.indexer = self._read_compressor("index_", tables, start, dtype, slot)
        return state

    def _slot_for(self, slot: int, pending: torch.Tensor) -> int:
        if slot < 0 and pending.numel():
            raise ValueError(
                f"the compressor state of positions {pending[0]}..{pending[-1]} sits in the "
                "sequence's state slot: give its slot (Segment.state_slot)"
            )
        return slot

    def _prev_span(
        self, tables: tuple[torch.Tensor, torch.Tensor], slot: int, window: int
    ) -> torch.Tensor:
        """The flat rows of window `window`'s first series (one sequence; `tables`: its main
        and window tables)."""
        m = self.geometry.rate
        positions = self._span(window * m, (window + 1) * m, tables[0].device)
        in_page = self._in_page(positions[-1:])
        if in_page is False or not bool(in_page):
            self._slot_for(slot, positions)
        return self._prev_rows(tables, slot, positions)

    def _read_compressor(
        self,
        prefix: str,
        tables: tuple[torch.Tensor, torch.Tensor],
        start: int,
        dtype: torch.dtype | None,
        slot: int,
    ) -> CompressorState:
        """`tables`: the main table (entries) and the window table (first series)."""
        table, m, dev = tables[0], self.geometry.rate, tables[0].device
        closed = start // m
        entries = torch.arange(closed, device=dev)
        pending = self._span(closed * m, start, dev)

        def get(name: str, rows: torch.Tensor) -> torch.Tensor:
            return self._load(f"{prefix}{name}", rows, dtype)

        open_rows = self._open_rows(self._slot_for(slot, pending), pending)
        state = CompressorState(
            get("entries", self._entry_rows(f"{prefix}entries", table, entries)),
            get("open_kv", open_rows),
            get("open_gate", open_rows),
        )
        if f"{prefix}prev_kv" in self.flat and closed > 0:
            prev = self._prev_span(tables, slot, closed - 1)
            state.prev_kv, state.prev_gate = get("prev_kv", prev), get("prev_gate", prev)
        return state

    def write(
        self,
        table: torch.Tensor,
        start: int,
        end: int,
        after: LayerState,
        slot: int = -1,
        window_table: torch.Tensor | None = None,
    ) -> None:
        """Store what a chunk of positions [start, end) leaves: the window rows `after` holds
        (`write_window`, through `window_table` as `read`), the entries its windows closed, the
        open window's rows and (CSA) the last closed window's first series. Fed a chunk block
        by block (`LayerGeometry.pieces`), it leaves every block's end state; the open rows go
        to the sequence's `slot` (needed where `end` is inside a window)."""
        tables = (table, table if window_table is None else window_table)
        self.write_window(tables[1], start, after)
        if self.geometry.rate:
            self._write_compressor("", tables, (start, end), after.compressor, slot)
            if self.geometry.kind == "compressed_sparse_attention":
                self._write_compressor("index_", tables, (start, end), after.indexer, slot)

    def write_window(self, window_table: torch.Tensor, start: int, after: LayerState) -> None:
        """The window rows of positions >= `start` that `after` holds, at their own rows."""
        new = after.window_pos >= start
        rows = self._rows_of("window", window_table, after.window_pos[new])
        self._save("window", rows, after.window_kv[new])

    def _write_compressor(
        self,
        prefix: str,
        tables: tuple[torch.Tensor, torch.Tensor],
        span: tuple[int, int],
        state: CompressorState,
        slot: int,
    ) -> None:
        """`tables`: the main table (entries) and the window table (first series)."""
        start, end = span
        table, m, dev = tables[0], self.geometry.rate, tables[0].device
        before, closed = start // m, end // m
        if closed > before:
            entries = torch.arange(before, closed, device=dev)
            self._save(
                f"{prefix}entries",
                self._entry_rows(f"{prefix}entries", table, entries),
                state.entries[before:closed],
            )
            if state.prev_kv is not None:
                prev = self._prev_span(tables, slot, closed - 1)
                self._save(f"{prefix}prev_kv", prev, state.prev_kv)
                self._save(f"{prefix}prev_gate", prev, state.prev_gate)
        pending = self._span(closed * m, end, dev)
        rows = self._open_rows(self._slot_for(slot, pending), pending)
        self._save(f"{prefix}open_kv", rows, state.pending_kv)
        self._save(f"{prefix}open_gate", rows, state.pending_gate)
