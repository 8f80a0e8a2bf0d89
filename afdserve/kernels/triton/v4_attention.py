"""DeepSeek-V4's attention of a ubatch (model/families/deepseek_v4/batched.py) in one launch: each
row's sliding window plus the compressed entries it selected, with one sink logit per head, read
straight from the pages (no gathered key tensor, no concatenation, no mask tensor).

V4's attention is MQA with K = V: one `dim`-wide row per key serves every head. So a program takes
one row and a block of heads, and each key tile it loads feeds both dots of all those heads (as
FlashMLA's sparse decode reads each selected key once for a head group). The keys of a row:
- window key i (0 <= i < WINDOW) is position p - i: from the chunk's own rows `OWN` when at or past
  the chunk's start, else from the window page at the flat row `WINDOW_ROWS[r, i]`; visible where
  the position is not negative;
- entry e (0 <= e < ENTRIES) is compressed entry w = `READ[r, e]`, closed at position (w + 1) m - 1:
  from the chunk's `NEW` rows when that is at or past the chunk's start, else from the entries
  page; visible where it closed at or before p (w < (p + 1) // m);
- or, `EVERY` (HCA), entry w for every w < (p + 1) // m: the loop stops at the row's own last
  entry, so a prefill row reads its causal extent and a captured step whose tables span
  max_model_len reads no further.
An entry's page row is found through the row's block table in the kernel (`_entry_rows`), so no
address tensor is made per layer.
That is `StepRows.chunk_or`'s rule, with the addresses `LayerPages` gives (cache.py keeps the
layout). An FP8 cache's pages (unrotated channels e4m3, rotated bf16) are read and widened in the
kernel as the torch path widens them (v4_pages.py). Softmax online in float32 from the sink (m =
sink, l = 1), so a row with every key masked gives zero, as the torch path. The window's and
READ's loop bounds are constexpr.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afdserve.kernels.triton.v4_pages import fp8_pages, page_rows, store_row

# Heads a program takes and keys per tile (not measured; the head block is tl.dot's minimum M, the
# tile keeps a head_dim 512 key tile at 16 KB of bf16).
BLOCK_HEADS = 16
BLOCK_KEYS = 32
# From PREFILL_ROWS rows a program takes PREFILL_BLOCK_HEADS heads: each key it loads then feeds
# that many heads, so a prefill step reads its keys 4x less often at V4-Flash's 64 heads, and
# enough programs remain to fill the GPU (a decode batch keeps the narrow block, for programs).
# 64 was the fastest of 16, 32 and 64 (docs/benchmarks.md, 2026-12-06; `tools/profile_prefill.py
# --set` sweeps them). A head_dim 512 block of 64 heads compiles for sm_90 without spills.
PREFILL_ROWS = 512
PREFILL_BLOCK_HEADS = 64


@triton.jit
def _online_tile(q, k, visible, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
    """One tile of keys k [BLOCK_KEYS, D] into the running max, sum and output of q's heads."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_HEADS, BLOCK_KEYS]
    s = tl.where(visible[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    pv = tl.dot(p.to(k.dtype), k, input_precision=PRECISION)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _entry_keys(
    NEW,
    ENTRY_PAGE,
    ENTRY_ROPE,
    read,
    paged,
    visible,
    own,
    r,
    p,
    rows,
    dim,
    d,
    nope,
    kv_scale,
    RATE: tl.constexpr,
    FP8: tl.constexpr,
):
    """The keys [BLOCK_KEYS, D] of entries `read`: the chunk's own pooled rows where `own`
    (closed at or past the chunk's start), else the entries page's flat rows `paged`."""
    live_d = d < dim
    own_row = tl.minimum(tl.maximum(r - (p - ((read + 1) * RATE - 1)), 0), rows - 1)
    k_own = tl.load(
        NEW + own_row[:, None] * dim + d[None, :],
        mask=(visible & own)[:, None] & live_d[None, :],
        other=0.0,
    )
    k_paged = page_rows(ENTRY_PAGE, ENTRY_ROPE, paged, visible & ~own, d, dim, nope, kv_scale, FP8)
    return tl.where(own[:, None], k_own, k_paged.to(k_own.dtype))


@triton.jit
def _entry_rows(
    TABLES, r, width, w, mask, RATE: tl.constexpr, BLOCK_SIZE: tl.constexpr, SLOTS: tl.constexpr
):
    """Flat rows of the entries page of entries `w` of row r (where `mask`): entry w sits in block
    w m // B of the row's table, at slot w - ceil(b B / m) (cache.LayerPages._entry_rows)."""
    block = w * RATE // BLOCK_SIZE
    first = (block * BLOCK_SIZE + RATE - 1) // RATE
    page_block = tl.load(TABLES + r * width + block, mask=mask, other=0)
    return page_block * SLOTS + w - first


@triton.jit
def _sparse_attention_kernel(
    Q,  # [rows, heads, dim]
    OWN,  # [rows, dim]: the chunk's own rotated KV
    WINDOW_PAGE,  # [flat rows, dim]
    WINDOW_ROPE,  # [flat rows, dim - nope] bf16: an FP8 cache's rotated channels (FP8)
    WINDOW_ROWS,  # [rows, WINDOW] int64
    NEW,  # [rows, dim]: the entry each chunk row pooled (ENTRIES > 0)
    ENTRY_PAGE,  # [flat rows, dim]
    ENTRY_ROPE,  # [flat rows, dim - nope] bf16 (FP8)
    READ,  # [rows, ENTRIES] int64: the entry indices (not EVERY)
    TABLES,  # [rows, width] int64: each row's block table
    POSITIONS,  # [rows] int64
    START,  # [rows] int64: the chunk's first position
    REAL,  # [rows] bool
    SINKS,  # [heads] float32
    OUT,  # [rows, heads, dim]
    rows,
    heads,
    dim,
    scale,
    width,
    nope,  # the unrotated channels, e4m3 in an FP8 cache's pages (FP8)
    kv_scale,  # an FP8 cache's scale (FP8)
    WINDOW: tl.constexpr,
    ENTRIES: tl.constexpr,
    RATE: tl.constexpr,
    EVERY: tl.constexpr,  # every closed entry (not READ)
    BLOCK_SIZE: tl.constexpr,  # the cache's block size
    SLOTS: tl.constexpr,  # entry rows per block of the entries page
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    FP8: tl.constexpr,  # the pages are an FP8 cache's pairs (v4_pages.py)
    STORE: tl.constexpr,  # write each real row's own key to its window row (WINDOW_ROWS[r, 0])
):
    r, head_block = tl.program_id(0), tl.program_id(1)
    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    live_d = d < dim
    q = tl.load(
        Q + r.to(tl.int64) * heads * dim + (h[:, None] * dim + d[None, :]),
        mask=(h[:, None] < heads) & live_d[None, :],
        other=0.0,
    )
    p = tl.load(POSITIONS + r)
    start = tl.load(START + r)
    real = tl.load(REAL + r).to(tl.int1)
    m_i = tl.load(SINKS + h, mask=h < heads, other=0.0).to(tl.float32)
    l_i = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)
    for t in range(0, WINDOW, BLOCK_N):
        i = t + n
        pos = p - i
        visible = (i < WINDOW) & (pos >= 0) & real
        own = pos >= start
        own_row = tl.minimum(tl.maximum(r - i, 0), rows - 1)
        paged = tl.load(WINDOW_ROWS + r * WINDOW + i, mask=visible & ~own, other=0)
        k_own = tl.load(
            OWN + own_row[:, None] * dim + d[None, :],
            mask=(visible & own)[:, None] & live_d[None, :],
            other=0.0,
        )
        k_paged = page_rows(
            WINDOW_PAGE, WINDOW_ROPE, paged, visible & ~own, d, dim, nope, kv_scale, FP8
        )
        k = tl.where(own[:, None], k_own, k_paged.to(k_own.dtype))
        m_i, l_i, acc = _online_tile(q, k, visible, m_i, l_i, acc, scale, PRECISION)
    closed = (p + 1) // RATE
    if EVERY:
        # Every closed entry (HCA): the loop stops at the row's last.
        steps = (tl.where(real, closed, 0) + BLOCK_N - 1) // BLOCK_N
        for i in range(0, steps):
            e = i * BLOCK_N + n
            visible = e < closed
            own = (e + 1) * RATE - 1 >= start
            paged = _entry_rows(TABLES, r, width, e, visible & ~own, RATE, BLOCK_SIZE, SLOTS)
            k = _entry_keys(
                NEW,
                ENTRY_PAGE,
                ENTRY_ROPE,
                e,
                paged,
                visible,
                own,
                r,
                p,
                rows,
                dim,
                d,
                nope,
                kv_scale,
                RATE,
                FP8,
            )
            m_i, l_i, acc = _online_tile(q, k, visible, m_i, l_i, acc, scale, PRECISION)
    else:
        for t in range(0, ENTRIES, BLOCK_N):
            e = t + n
            read = tl.load(READ + r * ENTRIES + e, mask=e < ENTRIES, other=0)
            visible = (e < ENTRIES) & (read < closed) & real
            own = (read + 1) * RATE - 1 >= start  # the position that closed the entry
            paged = _entry_rows(TABLES, r, width, read, visible & ~own, RATE, BLOCK_SIZE, SLOTS)
            k = _entry_keys(
                NEW,
                ENTRY_PAGE,
                ENTRY_ROPE,
                read,
                paged,
                visible,
                own,
                r,
                p,
                rows,
                dim,
                d,
                nope,
                kv_scale,
                RATE,
                FP8,
            )
            m_i, l_i, acc = _online_tile(q, k, visible, m_i, l_i, acc, scale, PRECISION)
    out = acc / l_i[:, None]
    tl.store(
        OUT + r.to(tl.int64) * heads * dim + (h[:, None] * dim + d[None, :]),
        out.to(OUT.dtype.element_ty),
        mask=(h[:, None] < heads) & live_d[None, :],
    )
    if STORE:
        # The row's own key to its position's window row (as the page keeps it), by the first
        # head block. No program of this launch reads that row: a row reads the page only before
        # its chunk's start, and every row it writes is at or past it.
        keep = live_d & real & (head_block == 0)
        row = tl.load(WINDOW_ROWS + r * WINDOW)
        x = tl.load(OWN + r * dim + d, mask=keep, other=0.0)
        store_row(WINDOW_PAGE, WINDOW_ROPE, row, x, d, keep, dim, nope, kv_scale, FP8)


def supports(
    q: torch.Tensor,
    own: torch.Tensor,
    page: torch.Tensor,
    rope_page: torch.Tensor | None = None,
) -> bool:
    """q [rows, heads, dim], own [rows, dim] of one float dtype, contiguous; a page in that dtype,
    or (`rope_page` given) an FP8 cache's pair (v4_pages.fp8_pages)."""
    return (
        q.dim() == 3
        and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and q.dtype == own.dtype
        and q.is_contiguous()
        and own.is_contiguous()
        and q.shape[-1] <= 1024
        and fp8_pages(q.dtype, page, rope_page, q.shape[-1]) is not None
    )


def sparse_attention(
    q: torch.Tensor,
    own: torch.Tensor,
    window_page: torch.Tensor,
    window_rows: torch.Tensor,
    entries: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None,
    rate: int,
    positions: torch.Tensor,
    start: torch.Tensor,
    real: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    paging: tuple[int, int] | None = None,
    rope_pages: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    kv_scale: float = 1.0,
    store: bool = False,
) -> torch.Tensor:
    """-> [rows, heads, dim] in q's dtype; `entries`: (new [rows, dim], the entries page, the
    rows' block tables [rows, W], the entry indices [rows, n] or None: every closed entry of each
    row, read up to the row's last (HCA: no [rows, entries] index tensor, no loop past the row's
    position)), or None (a sliding layer); `paging` (with entries): the cache's block size and
    the entries page's rows per block; `rope_pages`: an FP8 cache's rotated pages of the window
    and the entries (None: a sliding layer's), whose other pages are then e4m3 at `kv_scale`;
    `store`: also write each real row's `own` key to the window page at `window_rows[r, 0]`
    (its position's row), as `LayerPages.store` would after the attention. See the module
    docstring for what each row sees."""
    rows, heads, dim = q.shape
    out = torch.empty_like(q)
    if rows == 0:
        return out
    window = window_rows.shape[1]
    if entries is None:
        new, entry_page, tables, read = own, window_page, window_rows, window_rows
        block_size, slots, count = 1, 1, 0
    else:
        if paging is None:
            raise ValueError("sparse_attention: entries need `paging` (block size, entry slots)")
        new, entry_page, tables, read = entries
        block_size, slots = paging
        count = 0 if read is None else read.shape[1]
        read = tables if read is None else read
    fp8 = rope_pages is not None
    window_rope, entry_rope = rope_pages if fp8 else (window_page, None)
    entry_rope = window_rope if entry_rope is None else entry_rope
    nope = dim - window_rope.shape[1] if fp8 else dim
    block_h = PREFILL_BLOCK_HEADS if rows >= PREFILL_ROWS else BLOCK_HEADS
    block_h = max(16, min(block_h, triton.next_power_of_2(heads)))  # tl.dot's least M is 16
    _sparse_attention_kernel[(rows, triton.cdiv(heads, block_h))](
        q,
        own,
        window_page,
        window_rope,
        window_rows.contiguous(),
        new.contiguous(),
        entry_page,
        entry_rope,
        read.contiguous(),
        tables.contiguous(),
        positions,
        start,
        real,
        sinks,
        out,
        rows,
        heads,
        dim,
        scale,
        tables.shape[1],
        nope,
        kv_scale,
        WINDOW=window,
        ENTRIES=count,
        RATE=max(rate, 1),
        EVERY=entries is not None and entries[3] is None,
        BLOCK_SIZE=block_size,
        SLOTS=slots,
        BLOCK_H=block_h,
        BLOCK_N=BLOCK_KEYS,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP8=fp8,
        STORE=store,
        # A head_dim of 512 keeps a [16, 512] float32 output and a [32, 512] key tile live: eight
        # warps hold them without spilling (chosen, not measured).
        num_warps=8 if dim > 128 else 4,
    )
    return out
