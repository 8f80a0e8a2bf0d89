"""DeepSeek-V4's lightning indexer scores of a ubatch (model/families/deepseek_v4/batched.py's
`_compressed`) in one launch: every entry the block table addresses, read from the indexer's
entries page (no gathered key tensor), scored for every row's query heads.

score(r, e) = sum_h w_h(r) relu(q_h(r) . k_e) / sqrt(dim), -inf where entry e has not closed at or
before the row's position p (e >= (p + 1) // m). Key e is the chunk's own pooled row `NEW` when it
closed at or past the chunk's start ((e + 1) m - 1 >= start), else the page row `ENTRY_ROWS[r,
e]`: `StepRows.chunk_or`'s rule, with the addresses `LayerPages` gives. One program per (row, block
of entries): the row's heads ride one dot against the block's keys. The dots multiply the keys'
dtype exactly and sum in float32, as the torch path's float32 einsum of the same values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afdserve.kernels.triton.v4_pages import fp8_pages, page_rows

BLOCK_ENTRIES = 64  # entries a program scores (not measured)


@triton.jit
def _index_scores_kernel(
    Q,  # [rows, heads, DIM]: the rotated index queries
    WEIGHTS,  # [rows, heads]: w_h before the head scale, rows `weights_row` apart
    NEW,  # [rows, DIM]: the entry each chunk row pooled
    PAGE,  # [flat rows, DIM]: the indexer's entries page (FP8: its e4m3 channels [flat, nope])
    ROPE_PAGE,  # [flat rows, DIM - nope] bf16: an FP8 cache's rotated channels (FP8)
    ENTRY_ROWS,  # [rows, count] int64
    POSITIONS,  # [rows] int64
    START,  # [rows] int64
    SCORES,  # [rows, count] float32
    rows,
    heads,
    weights_row,
    weight_scale,
    count,
    scale,
    nope,  # the unrotated channels (FP8)
    kv_scale,  # an FP8 cache's scale (FP8)
    RATE: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PRECISION: tl.constexpr,
    FP8: tl.constexpr,  # PAGE and ROPE_PAGE are an FP8 cache's pair (v4_pages.py)
):
    r, block = tl.program_id(0), tl.program_id(1)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    e = block * BLOCK_E + tl.arange(0, BLOCK_E)
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
    inside = e < count
    visible = inside & (e < (p + 1) // RATE)
    at = (e + 1) * RATE - 1  # the position that closed entry e
    own = at >= start
    own_row = tl.minimum(tl.maximum(r - (p - at), 0), rows - 1)
    paged = tl.load(ENTRY_ROWS + r * count + e, mask=inside & ~own, other=0)
    k_own = tl.load(
        NEW + own_row[:, None] * DIM + d[None, :],
        mask=(inside & own)[:, None] & live_d[None, :],
        other=0.0,
    )
    k_paged = page_rows(PAGE, ROPE_PAGE, paged, inside & ~own, d, DIM, nope, kv_scale, FP8)
    k = tl.where(own[:, None], k_own, k_paged.to(k_own.dtype))
    dots = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_H, BLOCK_E]
    scores = tl.sum(tl.maximum(dots, 0.0) * scale * w[:, None], axis=0)
    scores = tl.where(visible, scores, float("-inf"))
    tl.store(SCORES + r * count + e, scores, mask=inside)


def supports(
    q: torch.Tensor,
    new: torch.Tensor,
    page: torch.Tensor,
    rope_page: torch.Tensor | None = None,
) -> bool:
    """q [rows, heads, dim] and new [rows, dim] of one float dtype, contiguous; the page in that
    dtype, or (`rope_page` given) an FP8 cache's pair (v4_pages.fp8_pages)."""
    return (
        q.dim() == 3
        and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and q.dtype == new.dtype
        and q.is_contiguous()
        and new.is_contiguous()
        and fp8_pages(q.dtype, page, rope_page, q.shape[-1]) is not None
        and q.shape[1] <= 128
        and q.shape[2] <= 512
    )


def index_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    new: torch.Tensor,
    page: torch.Tensor,
    entry_rows: torch.Tensor,
    rate: int,
    positions: torch.Tensor,
    start: torch.Tensor,
    rope_page: torch.Tensor | None = None,
    kv_scale: float = 1.0,
    weight_scale: float = 1.0,
) -> torch.Tensor:
    """-> scores [rows, count] float32 of every entry `entry_rows` [rows, count] addresses (the
    module docstring says which key each is and which are -inf); `rope_page`: an FP8 cache's
    rotated channels, `page` then its e4m3 ones at `kv_scale`; weights [rows, heads] (any float
    dtype, rows may lie apart) times `weight_scale` in float32 are the heads' weights."""
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    rows, heads, dim = q.shape
    count = entry_rows.shape[1]
    scores = torch.empty(rows, count, dtype=torch.float32, device=q.device)
    if rows == 0 or count == 0:
        return scores
    _index_scores_kernel[(rows, triton.cdiv(count, BLOCK_ENTRIES))](
        q,
        weights,
        new,
        page,
        page if rope_page is None else rope_page,
        entry_rows.contiguous(),
        positions,
        start,
        scores,
        rows,
        heads,
        weights.stride(0),
        weight_scale,
        count,
        dim**-0.5,
        dim if rope_page is None else dim - rope_page.shape[1],
        kv_scale,
        RATE=rate,
        DIM=dim,
        BLOCK_H=max(16, triton.next_power_of_2(heads)),
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_E=BLOCK_ENTRIES,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP8=rope_page is not None,
        num_warps=8 if heads * dim > 4096 else 4,  # 64 heads of 128: a 32 KB q tile (not measured)
    )
    return scores
