"""DeepSeek-V4's compressor addresses for a ubatch in one launch: what `_compress_addresses`
(model/families/deepseek_v4/batched.py) builds from the rows alone in about fifty small torch
ops, the flat rows the compressor kernels read and write. On a decode step a graph replays those
ops anyway; an eager mixed step pays a launch for each, once per page layout.

One program per row r, at position p in window w = p // m of slot s (pad rows, s = -1, read slot
0's rows). The address columns, as the torch form concatenates them:
- m + 1 open-ring rows of positions w m .. w m + m - 1 and p: open + s R + (q mod R);
- OVERLAP (CSA): 2 m rows of the first series of positions w m - m .. w m + m - 1: in the page of
  the window's block (`prev_page_rows` rows a block) where the window ends a block (and the series
  is kept in pages: not PREV_IN_SLOT), else in the slot's ring (prev + s R + (q mod R));
- OVERLAP and CHUNK: m open-ring rows of positions w m - m .. w m - 1.
Then the entry row of the entry p closes (entry max((p + 1) // m - 1, 0) through the row's table)
and, for chunks, which rows keep their window's first series and which their projections in the
open ring (`_keeps`). Every division and remainder is Python's floor form (positions before 0
occur), written on non-negative operands so the compiled kernel and the interpreter agree.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _floor_div(a, b):
    return tl.where(a >= 0, a // b, -((b - 1 - a) // b))


@triton.jit
def _mod(a, b):
    return a - _floor_div(a, b) * b


@triton.jit
def _prev_rows(q, s, table, t_stride, r, prev_base, ring, rate, block, prev_page_rows, span,
               PREV_IN_SLOT: tl.constexpr):  # fmt: skip
    """Flat rows of the first series of positions q [cols] (`LayerPages._prev_rows`)."""
    ring_row = prev_base + s * ring + _mod(q, ring)
    if PREV_IN_SLOT:
        return ring_row
    in_page = ((_floor_div(q, rate) + 1) * rate) % block == 0
    qc = tl.minimum(tl.maximum(q, 0), span - 1)
    blk = tl.load(table + r * t_stride + qc // block)
    return tl.where(in_page, blk * prev_page_rows + qc % prev_page_rows, ring_row)


@triton.jit(
    do_not_specialize=["t_stride", "w_stride", "out_stride", "open_base", "prev_base", "width",
                       "prev_width"]
)  # fmt: skip
def _addresses_kernel(
    POS,  # [rows] int64
    SLOT,  # [rows] int64, -1: a pad row
    TABLE,  # [rows, W] int64, rows t_stride apart
    WTABLE,  # [rows, W] int64: the window tables (the prev pages' where pooled)
    END,  # [rows] int64 (CHUNK)
    REAL,  # [rows] bool (CHUNK)
    OUT,  # [rows, cols] int64
    ENTRY,  # [rows] int64
    KEEP_PREV,  # [rows] bool (CHUNK)
    KEEP_OPEN,  # [rows] bool (CHUNK)
    t_stride,
    w_stride,
    out_stride,
    open_base,
    prev_base,
    width,  # blocks the main tables address
    prev_width,  # blocks the first series' tables address (the window tables' where pooled)
    M: tl.constexpr,
    M_PAD: tl.constexpr,  # a power of two >= 2 M
    RING: tl.constexpr,
    BLOCK: tl.constexpr,  # tokens a block
    ENTRY_SLOTS: tl.constexpr,  # entries a block's page holds
    PREV_PAGE_ROWS: tl.constexpr,
    OVERLAP: tl.constexpr,
    CHUNK: tl.constexpr,
    PREV_IN_SLOT: tl.constexpr,
    PREV_POOLED: tl.constexpr,
):
    r = tl.program_id(0)
    p = tl.load(POS + r)
    s = tl.maximum(tl.load(SLOT + r), 0)
    w = p // M  # p >= 0
    span = width * BLOCK
    j = tl.arange(0, M_PAD)
    out = OUT + r * out_stride
    # m + 1 open rows: the window's members, then p itself.
    q = tl.where(j < M, w * M + j, p)
    tl.store(out + j, open_base + s * RING + _mod(q, RING), mask=j <= M)
    col = M + 1
    if OVERLAP:
        q = w * M - M + j  # 2 M positions: windows w - 1 and w
        table = WTABLE if PREV_POOLED else TABLE
        stride = w_stride if PREV_POOLED else t_stride
        prev_span = prev_width * BLOCK
        rows = _prev_rows(
            q, s, table, stride, r, prev_base, RING, M, BLOCK, PREV_PAGE_ROWS, prev_span,
            PREV_IN_SLOT,
        )  # fmt: skip
        tl.store(out + col + j, rows, mask=j < 2 * M)
        col += 2 * M
        if CHUNK:  # window w - 1's open rows: q's first M
            tl.store(out + col + j, open_base + s * RING + _mod(q, RING), mask=j < M)
    # The entry p closes, clamped into the entries the table addresses.
    count = (span + M - 1) // M
    entry = tl.minimum(tl.maximum((p + 1) // M - 1, 0), count - 1)
    blk = entry * M // BLOCK
    first = (blk * BLOCK + M - 1) // M
    tl.store(ENTRY + r, tl.load(TABLE + r * t_stride + blk) * ENTRY_SLOTS + entry - first)
    if CHUNK:
        end = tl.load(END + r)
        real = tl.load(REAL + r) != 0
        closes = real & ((p + 1) % M == 0)
        kept = w * M >= end - RING
        if not PREV_IN_SLOT:
            kept = kept | (((w + 1) * M) % BLOCK == 0)  # the window ends a block: in its pages
        tl.store(KEEP_PREV + r, closes & kept)
        tl.store(KEEP_OPEN + r, real & (p >= end - RING) & ((p + 1) % M != 0))


def addresses(
    positions: torch.Tensor,
    slots: torch.Tensor,
    tables: torch.Tensor,
    windows: torch.Tensor,
    end: torch.Tensor,
    real: torch.Tensor,
    geometry: tuple[int, int, int, int, int],
    bases: tuple[int, int],
    overlap: bool,
    chunk: bool,
    prev: tuple[bool, bool],
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(addresses [rows, cols], entry rows [rows], (keep first series, keep open rows) [rows]
    each or None for decode). `geometry`: (m, ring rows, block size, entries a block, first
    series' page rows a block); `bases`: the open and first-series rings' slot-0 rows;
    `prev`: (first series in the slot, its pages in the window pool)."""
    m, ring, block, entry_slots, prev_page_rows = geometry
    rows, dev = positions.shape[0], positions.device
    cols = m + 1 + (2 * m + (m if chunk else 0) if overlap else 0)
    out = torch.empty(rows, cols, dtype=torch.int64, device=dev)
    entry = torch.empty(rows, dtype=torch.int64, device=dev)
    keep_prev = torch.empty(rows if chunk else 0, dtype=torch.bool, device=dev)
    keep_open = torch.empty(rows if chunk else 0, dtype=torch.bool, device=dev)
    if rows:
        _addresses_kernel[(rows,)](
            positions,
            slots,
            tables,
            windows,
            end,
            real,
            out,
            entry,
            keep_prev,
            keep_open,
            tables.stride(0),
            windows.stride(0),
            out.stride(0),
            bases[0],
            bases[1],
            tables.shape[1],
            (windows if prev[1] else tables).shape[1],
            M=m,
            M_PAD=max(2, triton.next_power_of_2(2 * m)),
            RING=ring,
            BLOCK=block,
            ENTRY_SLOTS=entry_slots,
            PREV_PAGE_ROWS=prev_page_rows,
            OVERLAP=overlap,
            CHUNK=chunk,
            PREV_IN_SLOT=prev[0],
            PREV_POOLED=prev[1],
            num_warps=1,
        )
    return out, entry, (keep_prev, keep_open) if chunk else None
