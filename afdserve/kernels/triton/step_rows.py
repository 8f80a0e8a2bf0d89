"""A ubatch's rows from its device segments in one launch: what `StepRows.of`
(model/families/deepseek_v4/rows.py) builds in about twenty small torch ops (a searchsorted, the
casts, pads and gathers of each per-segment field), once per ubatch, for DeepSeek-V4's layers and
DSA's indexer. And the rows' window addresses in one more (`window_rows`), once per page layout.

One program per block of rows. Row r is in segment i when query_start[i] <= r < query_start[i+1]:
i is the count of segment ends at or before r, which the program sums over the ends in blocks
(no host-known bound: a graph replays it for whatever segments the step has). Rows past the last
segment are pad rows: context 0, a zero table row, slot -1, as the torch form's appended pad
segment gives them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SEGMENT_BLOCK = 128  # segment ends compared at once
ROW_BLOCK = 16
COLUMN_BLOCK = 128  # table columns copied at once


@triton.jit
def _copy_table_rows(src, src_stride, dst, width, seg, real_seg, row, row_ok,
                     ROWS: tl.constexpr, COLUMNS: tl.constexpr):  # fmt: skip
    """dst[row, :width] = src[seg, :width] as int64, a zero row where not real_seg."""
    col = tl.arange(0, COLUMNS)
    for c0 in range(0, width, COLUMNS):
        c = c0 + col
        c_ok = c < width
        values = tl.load(
            src + seg.to(tl.int64)[:, None] * src_stride + c[None, :],
            mask=(row_ok & real_seg)[:, None] & c_ok[None, :],
            other=0,
        )
        tl.store(
            dst + row.to(tl.int64)[:, None] * width + c[None, :],
            values.to(tl.int64),
            mask=row_ok[:, None] & c_ok[None, :],
        )


@triton.jit(do_not_specialize=["rows", "segments", "width", "window_width"])
def _rows_kernel(
    QUERY_START,  # [segments + 1] int32
    CONTEXT,  # [segments] int32
    TABLES,  # [segments, >= width], rows tables_stride apart
    SLOTS,  # [segments] (HAS_SLOTS)
    WINDOW,  # [segments, >= window_width] (HAS_WINDOW)
    TABLES_OUT,  # [rows, width] int64
    REAL_OUT,  # [rows] bool
    START_OUT,  # [rows] int64
    END_OUT,  # [rows] int64
    SLOTS_OUT,  # [rows] int64 (HAS_SLOTS)
    WINDOW_OUT,  # [rows, window_width] int64 (HAS_WINDOW)
    rows,
    segments,
    width,
    window_width,
    tables_stride,
    window_stride,
    HAS_SLOTS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    ROWS: tl.constexpr,
    SEGMENTS: tl.constexpr,
    COLUMNS: tl.constexpr,
):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = row < rows
    seg = tl.zeros((ROWS,), dtype=tl.int32)
    s = tl.arange(0, SEGMENTS)
    for s0 in range(0, segments, SEGMENTS):
        ends = tl.load(QUERY_START + 1 + s0 + s, mask=s0 + s < segments, other=2147483647)
        seg += tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), axis=1)
    real_seg = seg < segments
    ok = row_ok & real_seg
    context = tl.load(CONTEXT + seg, mask=ok, other=0).to(tl.int64)
    first = tl.load(QUERY_START + seg, mask=ok, other=0).to(tl.int64)
    last = tl.load(QUERY_START + seg + 1, mask=ok, other=0).to(tl.int64)
    tl.store(REAL_OUT + row, context > 0, mask=row_ok)
    tl.store(START_OUT + row, context - (last - first), mask=row_ok)
    tl.store(END_OUT + row, context, mask=row_ok)
    if HAS_SLOTS:
        slot = tl.load(SLOTS + seg, mask=ok, other=-1).to(tl.int64)
        tl.store(SLOTS_OUT + row, slot, mask=row_ok)
    _copy_table_rows(TABLES, tables_stride, TABLES_OUT, width, seg, real_seg, row, row_ok,
                     ROWS, COLUMNS)  # fmt: skip
    if HAS_WINDOW:
        _copy_table_rows(WINDOW, window_stride, WINDOW_OUT, window_width, seg, real_seg, row,
                         row_ok, ROWS, COLUMNS)  # fmt: skip


def step_rows(
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    rows: int,
    slots: torch.Tensor | None,
    window_tables: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """(tables [rows, W] int64, real [rows] bool, start, end [rows] int64, slots [rows] int64 or
    None, window tables [rows, W'] int64 or None) of `StepRows.of`, from the segments' query
    starts [n + 1], context lengths [n], block tables [n, W] (unit column stride), state slots
    [n] and window tables [n, W']. Runs on CPU tensors under TRITON_INTERPRET=1 too."""
    device = query_start.device
    segments, width = block_tables.shape
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    tables = torch.empty(rows, width, dtype=torch.int64, device=device)
    real = torch.empty(rows, dtype=torch.bool, device=device)
    start = torch.empty(rows, dtype=torch.int64, device=device)
    end = torch.empty(rows, dtype=torch.int64, device=device)
    slots_out = None if slots is None else torch.empty(rows, dtype=torch.int64, device=device)
    window_out = None
    if window_tables is not None:
        if window_tables.stride(-1) != 1:
            window_tables = window_tables.contiguous()
        window_out = torch.empty(rows, window_tables.shape[1], dtype=torch.int64, device=device)
    if rows == 0:
        return tables, real, start, end, slots_out, window_out
    window = block_tables if window_tables is None else window_tables
    _rows_kernel[(triton.cdiv(rows, ROW_BLOCK),)](
        query_start,
        context_lens,
        block_tables,
        context_lens if slots is None else slots,  # unread without slots
        window,
        tables,
        real,
        start,
        end,
        start if slots_out is None else slots_out,  # unwritten without slots
        tables if window_out is None else window_out,  # unwritten without window tables
        rows,
        segments,
        width,
        window.shape[1],
        max(1, block_tables.stride(0)),
        max(1, window.stride(0)),
        HAS_SLOTS=slots is not None,
        HAS_WINDOW=window_tables is not None,
        ROWS=ROW_BLOCK,
        SEGMENTS=SEGMENT_BLOCK,
        COLUMNS=COLUMN_BLOCK,
        num_warps=4,
    )
    return tables, real, start, end, slots_out, window_out


@triton.jit(do_not_specialize=["span", "tables_stride"])
def _window_rows_kernel(
    POSITIONS,  # [rows] int64
    TABLES,  # [rows, W] int64, rows tables_stride apart
    OUT,  # [rows, window] int64
    window,
    span,  # W * block: the positions the tables address
    block,
    page_rows,
    tables_stride,
    WINDOW: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    back = tl.arange(0, WINDOW)
    ok = back < window
    position = tl.load(POSITIONS + row)
    q = tl.minimum(tl.maximum(position - back, 0), span - 1)
    page = tl.load(TABLES + row * tables_stride + q // block, mask=ok, other=0)
    tl.store(OUT + row * window + back, page * page_rows + q % page_rows, mask=ok)


def window_rows(
    positions: torch.Tensor, tables: torch.Tensor, window: int, block: int, page_rows: int
) -> torch.Tensor:
    """[rows, window] the flat window-page rows of positions p, p - 1, .. p - window + 1 of each
    row (`LayerPages.batch_rows("window", tables, back)`): each clamped into the W * block
    positions the row's table [W] addresses (a clamped read is always masked), its page's row
    `page_rows` a page."""
    rows = positions.shape[0]
    out = torch.empty(rows, window, dtype=torch.int64, device=positions.device)
    if rows == 0 or window == 0:
        return out
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    _window_rows_kernel[(rows,)](
        positions,
        tables,
        out,
        window,
        tables.shape[1] * block,
        block,
        page_rows,
        tables.stride(0),
        WINDOW=triton.next_power_of_2(window),
        num_warps=1 if window <= 128 else 4,
    )
    return out
