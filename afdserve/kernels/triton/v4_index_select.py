"""DeepSeek-V4's lightning indexer selection of a ubatch (model/families/deepseek_v4/batched.py's
`_index_top`) in two launches per block of rows: every row's scores over the entries closed at or
before it, then its `topk` best entries. Nothing the size of rows x max_model_len is allocated:
the scores of a long step are taken in row chunks of at most SCORE_ELEMENTS, and each row reads
only its causal extent, so a captured step whose tables span max_model_len reads no further.

Scores: score(r, e) = sum_h w_h(r) relu(q_h(r) . k_e) / sqrt(dim) for e < (p + 1) // m. Key e
is the chunk's own pooled row `NEW` when it closed at or past the chunk's start ((e + 1) m - 1
>= start), else the indexer's entries page row of entry e, found through the row's block table
(block e m // B, slot e - ceil(b B / m): cache.LayerPages._entry_rows). One program per (row,
split); split s scores the entry blocks s, s + SPLITS, ... (a loop bound, not a branch).

Top-k: one program per row finds the k-th largest score by radix select (dsa_indexer.py's, over
the scores as order-preserving integers) and keeps every entry above it and the earliest of those
equal to it: the set the torch path's stable descending sort keeps (`Indexer.ranked`), ties
included. Kept entries come in index order, then `fill` (an index no row sees: never visible).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afdserve.kernels.triton import v4_indexer
from afdserve.kernels.triton.dsa_indexer import _order_key, radix_threshold
from afdserve.kernels.triton.v4_pages import page_rows

BLOCK_ENTRIES = 64  # entries a score step reads (not measured)
SPLITS = 16  # programs per row scoring entries (not measured)
BLOCK_SCORES = 1024  # scores a top-k step reads
# Scratch scores held at once, [rows, entries] float32 (256 MiB): a long prefill is selected in
# row chunks of this many elements.
SCORE_ELEMENTS = 1 << 26


@triton.jit
def _scores_kernel(
    Q,  # [rows, heads, DIM]: the rotated index queries
    WEIGHTS,  # [rows, heads]: w_h before the head scale, rows `weights_row` apart
    NEW,  # [rows, DIM]: the entry each chunk row pooled
    PAGE,  # [flat rows, DIM]: the indexer's entries page (FP8: its e4m3 channels [flat, nope])
    ROPE_PAGE,  # [flat rows, DIM - nope] bf16: an FP8 cache's rotated channels (FP8)
    TABLES,  # [rows, width] int64
    POSITIONS,  # [rows] int64
    START,  # [rows] int64
    REAL,  # [rows] bool
    SCORES,  # [chunk rows, count] float32, written up to each row's last closed entry
    row0,  # the chunk's first row
    rows,
    heads,
    weights_row,
    weight_scale,
    width,
    count,
    scale,
    nope,  # the unrotated channels (FP8)
    kv_scale,  # an FP8 cache's scale (FP8)
    RATE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # the cache's block size
    SLOTS: tl.constexpr,  # entry rows per block of the page
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    FP8: tl.constexpr,  # PAGE and ROPE_PAGE are an FP8 cache's pair (v4_pages.py)
):
    local, split = tl.program_id(0), tl.program_id(1)
    r = row0 + local
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    live_d = d < DIM
    q = tl.load(
        Q + r.to(tl.int64) * heads * DIM + (h[:, None] * DIM + d[None, :]),
        mask=(h[:, None] < heads) & live_d[None, :],
        other=0.0,
    )
    w = tl.load(WEIGHTS + r * weights_row + h, mask=h < heads, other=0.0).to(tl.float32)
    w = w * weight_scale  # in float32, as `Indexer.score`
    p = tl.load(POSITIONS + r)
    start = tl.load(START + r)
    closed = tl.where(tl.load(REAL + r).to(tl.int1), (p + 1) // RATE, 0)
    steps = ((closed + BLOCK_E - 1) // BLOCK_E - split + SPLITS - 1) // SPLITS
    for i in range(0, steps):
        e = (split + i * SPLITS) * BLOCK_E + tl.arange(0, BLOCK_E)
        seen = e < closed
        at = (e + 1) * RATE - 1  # the position that closed entry e
        own = at >= start
        own_row = tl.minimum(tl.maximum(r - (p - at), 0), rows - 1)
        block = e * RATE // BLOCK_SIZE
        page_block = tl.load(TABLES + r * width + block, mask=seen & ~own, other=0)
        paged = page_block * SLOTS + e - (block * BLOCK_SIZE + RATE - 1) // RATE
        k_own = tl.load(
            NEW + own_row[:, None] * DIM + d[None, :],
            mask=(seen & own)[:, None] & live_d[None, :],
            other=0.0,
        )
        k_paged = page_rows(PAGE, ROPE_PAGE, paged, seen & ~own, d, DIM, nope, kv_scale, FP8)
        k = tl.where(own[:, None], k_own, k_paged.to(k_own.dtype))
        dots = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_H, BLOCK_E]
        scores = tl.sum(tl.maximum(dots, 0.0) * scale * w[:, None], axis=0)
        tl.store(SCORES + local * count + e, scores, mask=seen)


@triton.jit
def _top_kernel(
    SCORES,  # [chunk rows, count] float32
    POSITIONS,  # [rows] int64
    REAL,  # [rows] bool
    OUT,  # [rows, TOPK] int64: the kept entries, `fill` after them
    row0,
    count,
    fill,
    RATE: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_O: tl.constexpr,
):
    local = tl.program_id(0)
    r = row0 + local
    p = tl.load(POSITIONS + r)
    closed = tl.where(tl.load(REAL + r).to(tl.int1), (p + 1) // RATE, 0)
    take_all = closed <= TOPK  # no more visible entries than kept ones
    threshold, remaining = radix_threshold(SCORES + local * count, closed, TOPK, BLOCK_S)
    steps = (closed + BLOCK_S - 1) // BLOCK_S
    kept = tl.zeros((), dtype=tl.int64)
    equal_seen = tl.zeros((), dtype=tl.int64)
    for i in range(0, steps):
        e = i * BLOCK_S + tl.arange(0, BLOCK_S)
        valid = e < closed
        key = _order_key(tl.load(SCORES + local * count + e, mask=valid, other=0.0))
        equal = valid & (key == threshold)
        equal_rank = equal_seen + tl.cumsum(equal.to(tl.int64), 0) - 1
        keep = valid & (take_all | (key > threshold) | (equal & (equal_rank < remaining)))
        at = kept + tl.cumsum(keep.to(tl.int64), 0) - 1
        tl.store(OUT + r * TOPK + at, e.to(tl.int64), mask=keep)
        kept += tl.sum(keep.to(tl.int64))
        equal_seen += tl.sum(equal.to(tl.int64))
    for j in range(0, TOPK, BLOCK_O):
        o = j + tl.arange(0, BLOCK_O)
        filler = tl.full([BLOCK_O], 0, tl.int64) + fill
        tl.store(OUT + r * TOPK + o, filler, mask=(o >= kept) & (o < TOPK))


def supports(
    q: torch.Tensor,
    new: torch.Tensor,
    page: torch.Tensor,
    topk: int,
    rope_page: torch.Tensor | None = None,
) -> bool:
    """What v4_indexer.py's scores take (the same inputs), and a top-k the kernel ranks."""
    return 1 <= topk <= 8192 and v4_indexer.supports(q, new, page, rope_page)


def index_select(
    q: torch.Tensor,
    weights: torch.Tensor,
    new: torch.Tensor,
    page: torch.Tensor,
    tables: tuple[torch.Tensor, int, int],
    rate: int,
    rows_at: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    topk: int,
    rope_page: torch.Tensor | None = None,
    kv_scale: float = 1.0,
    weight_scale: float = 1.0,
) -> torch.Tensor:
    """-> [rows, topk] int64: each row's kept entries in index order, then ceil(W B / m) (no
    row's: never visible). tables: (the rows' block tables [rows, W], the cache's block size,
    entry rows per block of `page`); rows_at: (positions, chunk starts, real); `rope_page`: an
    FP8 cache's rotated channels, `page` then its e4m3 ones at `kv_scale`; weights as
    v4_indexer.index_scores' (times `weight_scale`)."""
    rows, heads, dim = q.shape
    table, block_size, slots = tables
    positions, start, real = (t.contiguous() for t in rows_at)
    width = table.shape[1]
    count = -(-width * block_size // rate)  # every entry the tables address
    out = torch.empty(rows, topk, dtype=torch.int64, device=q.device)
    if rows == 0:
        return out
    table = table.long().contiguous()
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    chunk = max(1, SCORE_ELEMENTS // max(count, 1))
    scores = torch.empty(min(rows, chunk), max(count, 1), dtype=torch.float32, device=q.device)
    for lo in range(0, rows, chunk):
        n = min(lo + chunk, rows) - lo
        _scores_kernel[(n, SPLITS)](
            q,
            weights,
            new,
            page,
            page if rope_page is None else rope_page,
            table,
            positions,
            start,
            real,
            scores,
            lo,
            rows,
            heads,
            weights.stride(0),
            weight_scale,
            width,
            count,
            dim**-0.5,
            dim if rope_page is None else dim - rope_page.shape[1],
            kv_scale,
            RATE=rate,
            BLOCK_SIZE=block_size,
            SLOTS=slots,
            DIM=dim,
            BLOCK_H=max(16, triton.next_power_of_2(heads)),
            BLOCK_D=max(16, triton.next_power_of_2(dim)),
            BLOCK_E=BLOCK_ENTRIES,
            SPLITS=SPLITS,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            FP8=rope_page is not None,
            num_warps=8 if heads * dim > 4096 else 4,  # 64 heads of 128: a 16 KB q tile
        )
        _top_kernel[(n,)](
            scores,
            positions,
            real,
            out,
            lo,
            count,
            count,
            RATE=rate,
            TOPK=topk,
            BLOCK_S=BLOCK_SCORES,
            BLOCK_O=min(1024, triton.next_power_of_2(topk)),
            num_warps=8,
        )
    return out
