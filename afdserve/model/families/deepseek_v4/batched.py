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

import torch

from afdserve.kernels import ops
from afdserve.model.families.deepseek_v4.attention import (
    Compressor,
    Indexer,
    RopeTable,
    V4Attention,
)
from afdserve.model.families.deepseek_v4.cache import LayerPages
from afdserve.model.families.deepseek_v4.rows import StepRows


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
    real = rows.real
    cos_sin = rows.rotary(rope)
    q_residual, q, kv, index_q = attn.project(x, cos_sin)
    kv = pages.as_stored(kv)
    window_rows = rows.shared(
        ("window", attn.window, pages.layout), lambda: _window_rows(attn.window, pages, rows)
    )
    selected = None
    if attn.compressor is not None:
        selected = _compressed(attn, pages, x, (q_residual, index_q), rows, compress_rope)
    out = _attend(attn, pages, q, kv, rows, window_rows, selected, store=True)
    y = attn.finish(out, cos_sin)
    return torch.where(real[:, None], y, 0.0)


def _window_rows(window: int, pages: LayerPages, rows: StepRows) -> torch.Tensor:
    """[rows, window] the flat window-page rows of positions p, p - 1, .. p - window + 1."""
    return pages.batch_window_rows(rows.windows, rows.positions, window)


def _attend(
    attn: V4Attention,
    pages: LayerPages,
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: StepRows,
    window_rows: torch.Tensor,
    selected: tuple[torch.Tensor | None, torch.Tensor] | None,
    store: bool = False,
) -> torch.Tensor:
    """q [rows, heads, dim] over each row's window (positions p - window + 1 .. p, masked where
    negative; the chunk's own `kv` rows, the page's `window_rows` before the chunk) and its
    `selected` compressed entries ((indices [rows, n] or None: every entry, the chunk's pooled
    `new` [rows, dim]), masked unless closed at or before p) -> [rows, heads, dim]: one fused
    launch on CUDA (ops.v4_sparse_attention, which finds each entry's page row through the row's
    block table, and for every entry reads them up to the row's last), the torch form below
    elsewhere (every entry the tables address, gathered per row). `store`: then write each real
    row's own key `kv` to its position's window row (`window_rows[:, 0]`), after every read of
    the window (the fused kernel in the same launch: no row reads a row another writes)."""
    p, comp = rows.positions, attn.compressor
    entries, paging = None, None
    if selected is not None:
        read, new = selected
        paging = (pages.geometry.block_size, pages.pages["entries"].shape[1])
        entries = (new, pages.flat["entries"], rows.tables, read)
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
        paging,
        fp8,
        store,
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
    out = attn.attend_batched(q, keys, allowed)
    if store:  # window_rows[:, 0] is p's row
        pages.store("window", window_rows[:, :1], kv[:, None], rows.real[:, None])
    return out


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
    residual: tuple[torch.Tensor, torch.Tensor | None],
    rows: StepRows,
    rope: RopeTable,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The compressed entries each row attends to, (indices [rows, n] or None, the entry each
    row pooled [rows, dim], which `_attend` reads for entries closed inside the chunk): HCA
    None, every entry closed at or before the row; CSA the indexer's top-k (`_index_top`).
    Entries at or past the (p + 1) // m closed ones are masked there. residual: the q residual
    and the indexer's q_b_proj of it where `V4Attention.project` made that (else None)."""
    comp = attn.compressor
    own, index = comp.project(x)
    if index is None:
        return None, _compress(comp, pages, "", own, rows, rope)
    indexer = comp.indexer
    q_residual, index_q = residual
    if index_q is None:
        index_q = indexer.q_b_proj(q_residual)
    index_new = _compress(indexer, pages, "index_", index[:2], rows, rope)
    projected = (index_q, index[2])
    top = _index_top(indexer, pages, x, q_residual, rows, rope, index_new, projected)
    return top, _compress(comp, pages, "", own, rows, rope)


def _index_top(
    indexer: Indexer,
    pages: LayerPages,
    x: torch.Tensor,
    q_residual: torch.Tensor,
    rows: StepRows,
    rope: RopeTable,
    new: torch.Tensor,
    projected: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The indexer's choice [rows, n]: on CUDA its top index_topk entries among those closed at
    or before the row, scored only that far (ops.v4_index_select: no [rows, entries] tensor
    beyond a bounded scratch, the rest an index no row sees); elsewhere every padded entry
    scored, invisible ones -inf, and `Indexer.ranked` (the per-sequence path's stable sort)
    keeps the first index_topk: visible entries come first, so a top-k beyond the visible
    count keeps all of them and masks the rest, as the per-sequence path. `projected`: the
    indexer's raw queries and weights where packed GEMMs made them (`Indexer.queries`)."""
    queries = indexer.queries(x, q_residual, rows.rotary(rope), projected)
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
        indexer.weight_scale,
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
    q, weights = queries or indexer.queries(x, q_residual, rows.rotary(rope))
    entry_rows = pages.batch_entry_rows("index_entries", rows.tables, every)
    page = pages.flat["index_entries"]
    fused = ops.v4_index_scores(
        q, weights, new, page, entry_rows, m, p, rows.start, _index_fp8(pages), indexer.weight_scale
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
    projected: tuple[torch.Tensor, torch.Tensor],
    rows: StepRows,
    rope: RopeTable,
) -> torch.Tensor:
    """Feed each row's projections (kv, gate: `Compressor.project`'s) to one compressor (pages
    `prefix`*: HCA's, CSA's or its indexer's) and write what the per-sequence path writes ->
    [rows, dim]: the entry of p's window w = p // m
    (positions [w m, (w + 1) m)), pooled for every row, kept where p closes it ((p + 1) % m == 0).
    The window's rows before the chunk come from the open rows, the others from the chunk; CSA's
    first series (window w - 1's) from prev_* when that window closed before the chunk, else as
    the window. Writes: each closed window's entry; the open rows of the chunk's last R
    positions (`LayerGeometry.ring`: those a rolled-back speculative step may resume among);
    prev_* by the row closing each window that ends a block or lies in those positions."""
    m, p, tables = comp.rate, rows.positions, rows.tables
    kv, gate = projected
    rope_dim = 2 * rope.inv_freq.shape[0]
    if ops.fuses_v4_compress(kv, pages.flat[f"{prefix}open_kv"], comp.dim, rope_dim):
        return _compress_fused(comp, pages, prefix, kv, gate, rows, rope)
    w, state_slots = p // m, rows.state_slots()
    closes, keep_first, keep_open = _keeps(pages, rows, m)
    members = w[:, None] * m + torch.arange(m, device=kv.device)  # [rows, m]: p's window
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
        last = keep_first[:, None].expand(-1, m)
        own_prev = pages.batch_prev_rows((tables, rows.windows), state_slots, members)
        pages.store(f"{prefix}prev_kv", own_prev, win_kv[..., :d], last)
        pages.store(f"{prefix}prev_gate", own_prev, win_gate[..., :d], last)
        win_kv, win_gate = comp.overlap_slots(first_kv, first_gate, win_kv, win_gate)
    recent = keep_open[:, None]
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


def _compress_fused(
    comp: Compressor,
    pages: LayerPages,
    prefix: str,
    kv: torch.Tensor,
    gate: torch.Tensor,
    rows: StepRows,
    rope: RopeTable,
) -> torch.Tensor:
    """`_compress` in ops.v4_compress's launches over the page rows LayerPages addresses
    -> [rows, dim]: one for a decode ubatch (each row alone in its chunk), three for chunks."""
    m, p = comp.rate, rows.positions
    names = ("open_kv", "open_gate", "entries") + (("prev_kv", "prev_gate") if comp.overlap else ())
    names += ("entries_rope",) if pages.fp8 else ()  # the kernel quantizes as `LayerPages.store`
    flat = {name: pages.flat[prefix + name] for name in names}
    # Both compressors of a CSA layer address their rings alike ("open_kv", "prev_kv" name
    # them all) and hold as many entries per block: one set of addresses for both.
    slots = pages.pages[f"{prefix}entries"].shape[1]
    key = ("compress", m, comp.overlap, slots, pages.layout)
    addresses, entry_rows, chunk = rows.shared(
        key, lambda: _compress_addresses(pages, f"{prefix}entries", m, comp.overlap, rows)
    )
    norm = (comp.kv_norm.weight, comp.kv_norm.eps)
    return ops.v4_compress(
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
        chunk,
    )


def _compress_addresses(
    pages: LayerPages, entries: str, m: int, overlap: bool, rows: StepRows
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """What `_compress_fused`'s kernels read and write, as flat rows: (the open rings' rows of
    the row's window and of p (in the row's slot), then (CSA, `overlap`) the first series' rows
    of window w - 1 (read) and of window w (written where p closes it), and for chunks the open
    rings' rows of window w - 1 [rows, 2 m + 1 (+ 2 m (+ m))]; the page row of the entry p
    closes [rows]; for chunks (not `rows.decode`) the kernels' `chunk`: the rows' chunk starts,
    which closing rows keep their window's first series and which rows their projections in
    the open ring, as `_compress` keeps them)."""
    fused = pages.fused_compress_addresses(entries, rows, m, overlap)
    if fused is not None:  # one launch where the kernels run
        addresses, entry_rows, keeps = fused
        return addresses, entry_rows, None if keeps is None else (rows.start, *keeps)
    return compress_addresses(pages, entries, m, overlap, rows)


def compress_addresses(
    pages: LayerPages, entries: str, m: int, overlap: bool, rows: StepRows
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """`_compress_addresses` in torch: the CPU path, and the kernel's oracle in the tests."""
    p, tables, slots = rows.positions, rows.tables, rows.state_slots()
    w = p // m
    members = w[:, None] * m + torch.arange(m, device=p.device)  # [rows, m]: p's window
    wanted = [pages.batch_open_rows(slots, torch.cat((members, p[:, None]), dim=1))]
    if overlap:
        prev = torch.cat((members - m, members), dim=1)
        wanted.append(pages.batch_prev_rows((tables, rows.windows), slots, prev))
        if not rows.decode:
            wanted.append(pages.batch_open_rows(slots, members - m))
    entry = ((p + 1) // m - 1).clamp(min=0)[:, None]
    entry_rows = pages.batch_entry_rows(entries, tables, entry)[:, 0]
    chunk = None if rows.decode else (rows.start, *_keeps(pages, rows, m)[1:])
    return torch.cat(wanted, dim=1), entry_rows, chunk


def _keeps(
    pages: LayerPages, rows: StepRows, m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[rows] each: which rows close their window ((p + 1) % m == 0); which of those keep the
    window's first series (CSA): a window ending a block (in its pages) and those in the
    chunk's last R positions (in the slot's ring, at their positions: a rollback may return
    into the window after any of them); and which rows keep their projections in the open
    ring: every row of the chunk's last R positions (distinct modulo R), not only the window
    open at its end, but a row closing its window (never read as open: a chunk resuming past
    it starts the next window)."""
    p, end, ring = rows.positions, rows.end, pages.geometry.ring
    closes = rows.real & ((p + 1) % m == 0)
    kept = pages.keeps_prev_in_page(p + 1) | (p // m * m >= end - ring)
    return closes, closes & kept, rows.real & (p >= end - ring) & ~closes
