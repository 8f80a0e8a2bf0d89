"""DeepSeek-V4 attention for a whole ubatch at once: prefill chunks of any length beside decodes.

Rows are grouped by segment (consecutive positions of one sequence, a chunk [start, end)); each
row carries its position, its segment's block table and its chunk's bounds (`StepRows`), and the
layer runs in tensor ops over cache.py's pages with no loop over sequences or tokens and no host
sync: shapes follow the row count and the block-table width W, never a sequence's length. A row
reads position q from its own chunk when q >= start (`StepRows.chunk_or`), else from the pages
(`LayerPages.read`'s contract). Each page row is written by the one row whose value
`LayerPages.write` would leave there (block by block where blocks resume: each completed block's
end state too; every row its own window row, through the window tables), after every read of
that page; a sequence writes only positions of its own chunk
and the entries and series of windows starting in it, so blocks shared by prefix caching (wholly
before the chunk) are never written and segment order does not matter. Pad rows write to the
pages' scratch row and give zero. full_decode_only graphs capture decode ubatches, `full` any.
On CUDA the attention, the indexer's scores and a decode ubatch's compressor update are fused
launches (ops.v4_*), over pages in the model dtype or an FP8 cache's (e4m3 beside bf16 rotated
channels, read and written in the kernels as `LayerPages` reads and writes them). There no
tensor grows as rows x context: HCA's attention reads each row's closed entries through its
table up to its own position, and CSA's indexer scores each row only that far, in row chunks of
bounded scratch; so a step of prefill chunks beside decodes, shapes fixed by the row count and
W, is what `full` graphs capture. The torch form (the CPU reference) gathers every entry the
table addresses, per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from afdserve.kernels import ops
from afdserve.kernels.metadata import AttentionMetadata
from afdserve.model.families.deepseek_v4.attention import (
    Compressor,
    Indexer,
    RopeTable,
    V4Attention,
)
from afdserve.model.families.deepseek_v4.cache import LayerPages


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

    @classmethod
    def of(
        cls, meta: AttentionMetadata, window: AttentionMetadata | None = None
    ) -> StepRows | None:
        """The rows of `meta`, or None when it carries no device segments (`batched`);
        `window`: the same rows through the window pool's tables (None: `meta`'s)."""
        batched = meta.batched
        if batched is None:
            return None
        query_start = batched.query_start.long()
        row = torch.arange(meta.num_rows, device=query_start.device)
        # Row r is in segment i when query_start[i] <= r < query_start[i + 1]; rows past the
        # last segment get index n, the pad segment appended here (no rows, context 0).
        segment = torch.searchsorted(query_start[1:], row, right=True)
        context = F.pad(batched.context_lens.long(), (0, 1))[segment]
        count = F.pad(query_start[1:] - query_start[:-1], (0, 1))[segment]
        tables = F.pad(batched.block_tables.long(), (0, 0, 0, 1))[segment]
        slots = batched.state_slots
        if slots is None and batched.context_lens.numel() == 0:  # pad rows only
            slots = batched.context_lens
        window_tables = None
        if window is not None and window is not meta:
            window_tables = F.pad(window.batched.block_tables.long(), (0, 0, 0, 1))[segment]
        return cls(
            meta.positions.long(),
            tables,
            context > 0,
            context - count,
            context,
            batched.max_query_len <= 1,
            None if slots is None else F.pad(slots.long(), (0, 1), value=-1)[segment],
            window_tables,
        )

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


def step_attention(
    attn: V4Attention,
    pages: LayerPages,
    x: torch.Tensor,
    rows: StepRows,
    rope: RopeTable,
    compress_rope: RopeTable,
) -> torch.Tensor:
    """One layer's attention of a ubatch: x [rows, hidden] -> [rows, hidden], as
    `V4Attention.forward` gives each chunk over `pages.read`'s state, with what `pages.write`
    would store written to the pages. The window of the row at p: positions p - window + 1 ..
    p, masked where negative; every row's own goes to its position's row of the window pages
    (so a row past what the sequence keeps, a rejected draft's, overwrites no other)."""
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    p, real = rows.positions, rows.real
    cos_sin = rope.at(p)
    q_residual, q, kv = attn.project(x, cos_sin)
    kv = pages.as_stored(kv)
    back = p[:, None] - torch.arange(attn.window, device=p.device)  # [rows, window]
    window_rows = pages.batch_rows("window", rows.windows, back)
    selected = None
    if attn.compressor is not None:
        selected = _compressed(attn, pages, x, q_residual, rows, compress_rope)
    out = _attend(attn, pages, q, kv, rows, window_rows, selected)
    # After every read of the window (fused kernels read the pages while rows are written).
    pages.store("window", window_rows[:, :1], kv[:, None], real[:, None])  # back[:, 0] is p
    y = attn.finish(out, cos_sin)
    return torch.where(real[:, None], y, torch.zeros_like(y))


def _attend(
    attn: V4Attention,
    pages: LayerPages,
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: StepRows,
    window_rows: torch.Tensor,
    selected: tuple[torch.Tensor | None, torch.Tensor] | None,
) -> torch.Tensor:
    """q [rows, heads, dim] over each row's window (positions p - window + 1 .. p, masked where
    negative; the chunk's own `kv` rows, the page's `window_rows` before the chunk) and its
    `selected` compressed entries ((indices [rows, n] or None: every entry, the chunk's pooled
    `new` [rows, dim]), masked unless closed at or before p) -> [rows, heads, dim]: one fused
    launch on CUDA (ops.v4_sparse_attention, which reads every closed entry through the tables
    up to the row's last), the torch form below elsewhere (every entry the tables address,
    gathered per row)."""
    p, comp = rows.positions, attn.compressor
    entries, every = None, None
    if selected is not None:
        read, new = selected
        if read is None:
            geometry = pages.geometry
            every = (geometry.block_size, pages.pages["entries"].shape[1])
            entries = (new, pages.flat["entries"], rows.tables, None)
        else:
            entries = (new, pages.flat["entries"], _entry_rows(pages, rows, read), read)
    fp8 = None
    if pages.fp8:  # the kernel widens the e4m3 channels as `LayerPages.take` does
        fp8 = (pages.flat["window_rope"], pages.flat.get("entries_rope"), pages.scale)
    fused = ops.v4_sparse_attention(
        q,
        kv,
        (pages.flat["window"], window_rows),
        entries,
        comp.rate if comp is not None else 0,
        (p, rows.start, rows.real),
        attn.sinks,
        attn.scale,
        every,
        fp8,
    )
    if fused is not None:
        return fused
    back = p[:, None] - torch.arange(attn.window, device=p.device)
    keys = rows.chunk_or(kv, back, pages.take("window", window_rows, kv.dtype))
    allowed = (back >= 0) & rows.real[:, None]
    if selected is not None:
        read, new = selected
        read = _every_entry(pages, rows, comp.rate) if read is None else read
        stored = pages.take("entries", _entry_rows(pages, rows, read), new.dtype)
        keys = torch.cat((keys, rows.chunk_or(new, (read + 1) * comp.rate - 1, stored)), dim=1)
        allowed = torch.cat((allowed, read < ((p + 1) // comp.rate)[:, None]), dim=1)
    return attn.attend_batched(q, keys, allowed)


def _every_entry(pages: LayerPages, rows: StepRows, rate: int) -> torch.Tensor:
    """[rows, n] every entry the tables can address (n = ceil(W B / m)), a broadcast view."""
    count = -(-rows.tables.shape[1] * pages.geometry.block_size // rate)
    return torch.arange(count, device=rows.tables.device).expand(rows.tables.shape[0], count)


def _entry_rows(pages: LayerPages, rows: StepRows, read: torch.Tensor) -> torch.Tensor:
    return pages.batch_entry_rows("entries", rows.tables, read)


def _compressed(
    attn: V4Attention,
    pages: LayerPages,
    x: torch.Tensor,
    q_residual: torch.Tensor,
    rows: StepRows,
    rope: RopeTable,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The compressed entries each row attends to, (indices [rows, n] or None, the entry each
    row pooled [rows, dim], which `_attend` reads for entries closed inside the chunk): HCA
    None, every entry closed at or before the row; CSA the indexer's top-k (`_index_top`).
    Entries at or past the (p + 1) // m closed ones are masked there."""
    comp = attn.compressor
    if comp.indexer is None:
        return None, _compress(comp, pages, "", x, rows, rope)
    indexer = comp.indexer
    index_new = _compress(indexer, pages, "index_", x, rows, rope)
    top = _index_top(indexer, pages, x, q_residual, rows, rope, index_new)
    return top, _compress(comp, pages, "", x, rows, rope)


def _index_top(
    indexer: Indexer,
    pages: LayerPages,
    x: torch.Tensor,
    q_residual: torch.Tensor,
    rows: StepRows,
    rope: RopeTable,
    new: torch.Tensor,
) -> torch.Tensor:
    """The indexer's choice [rows, n]: on CUDA its top index_topk entries among those closed at
    or before the row, scored only that far (ops.v4_index_select: no [rows, entries] tensor
    beyond a bounded scratch, the rest an index no row sees); elsewhere every padded entry
    scored, invisible ones -inf, and `Indexer.ranked` (the per-sequence path's stable sort)
    keeps the first index_topk: visible entries come first, so a top-k beyond the visible
    count keeps all of them and masks the rest, as the per-sequence path."""
    queries = indexer.queries(x, q_residual, rows.positions, rope)
    geometry, page = pages.geometry, pages.pages["index_entries"]
    top = ops.v4_index_select(
        *queries,
        new,
        pages.flat["index_entries"],
        (rows.tables, geometry.block_size, page.shape[1]),
        indexer.rate,
        (rows.positions, rows.start, rows.real),
        indexer.topk,
        _index_fp8(pages),
    )
    if top is not None:
        return top
    return indexer.ranked(_index_scores(indexer, pages, x, q_residual, rows, rope, new, queries))


def _index_fp8(pages: LayerPages) -> tuple[torch.Tensor, float] | None:
    """An FP8 cache's rotated channels of the indexer's entries and its scale, which the fused
    kernels take beside the e4m3 page to widen it as `LayerPages.take` does (None: bf16 pages)."""
    return (pages.flat["index_entries_rope"], pages.scale) if pages.fp8 else None


def _index_scores(
    indexer: Indexer,
    pages: LayerPages,
    x: torch.Tensor,
    q_residual: torch.Tensor,
    rows: StepRows,
    rope: RopeTable,
    new: torch.Tensor,
    queries: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The indexer's score [rows, n] of every entry the table can address (n = ceil(W B / m)),
    -inf where not closed at or before the row: one launch on CUDA (ops.v4_index_scores), the
    gathered keys and `Indexer.score` elsewhere. `new` [rows, dim]: the entry each row pooled;
    `queries`: `Indexer.queries` of the rows, where already made."""
    m, p = indexer.rate, rows.positions
    count = -(-rows.tables.shape[1] * pages.geometry.block_size // m)
    every = torch.arange(count, device=x.device).expand(x.shape[0], count)
    q, weights = queries or indexer.queries(x, q_residual, p, rope)
    entry_rows = pages.batch_entry_rows("index_entries", rows.tables, every)
    page = pages.flat["index_entries"]
    fused = ops.v4_index_scores(
        q, weights, new, page, entry_rows, m, p, rows.start, _index_fp8(pages)
    )
    if fused is not None:
        return fused
    keys = rows.chunk_or(
        new, (every + 1) * m - 1, pages.take("index_entries", entry_rows, new.dtype)
    )
    scores = indexer.score(q, weights, keys)
    return scores.masked_fill(every >= ((p + 1) // m)[:, None], float("-inf"))


def _compress(
    comp: Compressor,
    pages: LayerPages,
    prefix: str,
    x: torch.Tensor,
    rows: StepRows,
    rope: RopeTable,
) -> torch.Tensor:
    """Feed each row's token to one compressor (pages `prefix`*: HCA's, CSA's or its indexer's)
    and write what the per-sequence path writes -> [rows, dim]: the entry of p's window w = p // m
    (positions [w m, (w + 1) m)), pooled for every row, kept where p closes it ((p + 1) % m == 0).
    The window's rows before the chunk come from the open rows, the others from the chunk; CSA's
    first series (window w - 1's) from prev_* when that window closed before the chunk, else as
    the window. Writes: each closed window's entry; the open rows of the chunk's last R
    positions (`LayerGeometry.ring`: those a rolled-back speculative step may resume among);
    prev_* by the row closing each window that ends a block or lies in those positions."""
    m, p, tables, end = comp.rate, rows.positions, rows.tables, rows.end
    kv, gate = comp.kv_proj(x), comp.gate_proj(x)
    rope_dim = 2 * rope.inv_freq.shape[0]
    if rows.decode and ops.fuses_v4_compress(
        kv, pages.flat[f"{prefix}open_kv"], comp.dim, rope_dim
    ):
        return _compress_decode(comp, pages, prefix, kv, gate, rows, rope)
    w, state_slots, ring = p // m, rows.state_slots(), pages.geometry.ring
    closes = rows.real & ((p + 1) % m == 0)
    members = w[:, None] * m + torch.arange(m, device=x.device)  # [rows, m]: p's window
    window = pages.batch_open_rows(state_slots, members)
    win_kv = rows.chunk_or(kv, members, pages.take(f"{prefix}open_kv", window))
    win_gate = rows.chunk_or(gate, members, pages.take(f"{prefix}open_gate", window))
    win_gate = win_gate + comp.position_bias
    if comp.overlap:
        d = comp.dim
        earlier = members - m
        # Window w - 1's rows: still open in the slot where it holds the chunk's start, its
        # first series in the prev pages where it closed before the chunk.
        open_earlier = pages.batch_open_rows(state_slots, earlier)
        pending = rows.chunk_or(kv, earlier, pages.take(f"{prefix}open_kv", open_earlier))
        pending_gate = rows.chunk_or(gate, earlier, pages.take(f"{prefix}open_gate", open_earlier))
        pending_gate = pending_gate + comp.position_bias
        previous = pages.batch_prev_rows((tables, rows.windows), state_slots, earlier)
        paged = (w * m <= rows.start)[:, None, None]  # window w - 1 closed before the chunk
        first_kv = torch.where(
            paged, pages.take(f"{prefix}prev_kv", previous, kv.dtype), pending[..., :d]
        )
        first_gate = torch.where(
            paged, pages.take(f"{prefix}prev_gate", previous).float(), pending_gate[..., :d].float()
        )
        first = (w > 0)[:, None, None]  # before window 0: no first series (weight 0)
        first_kv = torch.where(first, first_kv, 0.0)
        first_gate = torch.where(first, first_gate, float("-inf")).to(win_gate.dtype)
        # Kept: a window ending a block (in its pages), and those in the chunk's last R
        # positions (in the slot's ring, at their positions: a rollback may return into the
        # window after any of them).
        kept = pages.keeps_prev_in_page(p + 1) | (w * m >= end - ring)
        last = (closes & kept)[:, None].expand(-1, m)
        own_prev = pages.batch_prev_rows((tables, rows.windows), state_slots, members)
        pages.store(f"{prefix}prev_kv", own_prev, win_kv[..., :d], last)
        pages.store(f"{prefix}prev_gate", own_prev, win_gate[..., :d], last)
        win_kv, win_gate = comp.overlap_slots(first_kv, first_gate, win_kv, win_gate)
    # Every row of the chunk's last R positions (distinct modulo R), not only the window open
    # at its end: a speculative step's rollback resumes inside any of them. A row closing its
    # window is never read as open (a chunk resuming past it starts the next window).
    recent = (rows.real & (p >= end - ring) & ~closes)[:, None]
    own = pages.batch_open_rows(state_slots, p[:, None])
    pages.store(f"{prefix}open_kv", own, kv[:, None], recent)
    pages.store(f"{prefix}open_gate", own, gate[:, None], recent)
    new = pages.as_stored(comp.pool(win_kv, win_gate, w * m, rope))  # [rows, dim]
    entry = ((p + 1) // m - 1).clamp(min=0)[:, None]
    pages.store(
        f"{prefix}entries",
        pages.batch_entry_rows(f"{prefix}entries", tables, entry),
        new[:, None],
        closes[:, None],
    )
    return new


def _compress_decode(
    comp: Compressor,
    pages: LayerPages,
    prefix: str,
    kv: torch.Tensor,
    gate: torch.Tensor,
    rows: StepRows,
    rope: RopeTable,
) -> torch.Tensor:
    """`_compress` of a decode ubatch (each row alone in its chunk) as one launch
    (ops.v4_compress_decode) over the page rows LayerPages addresses -> [rows, dim]."""
    m, p, tables = comp.rate, rows.positions, rows.tables
    members = (p // m)[:, None] * m + torch.arange(m, device=p.device)  # [rows, m]: p's window
    names = ("open_kv", "open_gate", "entries") + (("prev_kv", "prev_gate") if comp.overlap else ())
    names += ("entries_rope",) if pages.fp8 else ()  # the kernel quantizes as `LayerPages.store`
    flat = {name: pages.flat[prefix + name] for name in names}
    entry = ((p + 1) // m - 1).clamp(min=0)[:, None]
    # The open rings' rows of the window and of p (in the row's slot), then (CSA) the first
    # series' rows of window w - 1 (read) and of window w (written where p closes it).
    open_rows = torch.cat((members, p[:, None]), dim=1)
    wanted = [pages.batch_open_rows(rows.state_slots(), open_rows)]
    if comp.overlap:
        prev = torch.cat((members - m, members), dim=1)
        wanted.append(pages.batch_prev_rows((tables, rows.windows), rows.state_slots(), prev))
    addresses = torch.cat(wanted, dim=1)
    entry_rows = pages.batch_entry_rows(f"{prefix}entries", tables, entry)[:, 0]
    norm = (comp.kv_norm.weight, comp.kv_norm.eps)
    return ops.v4_compress_decode(
        kv,
        gate,
        flat,
        addresses,
        entry_rows,
        comp.position_bias,
        norm,
        (rope.inv_freq, rope.scaling),
        p,
        rows.real,
        m,
        comp.dim,
        pages.scale,
    )
