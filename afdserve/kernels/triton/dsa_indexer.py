"""DeepSeek Sparse Attention's lightning indexer (model/families/dsa/indexer.py) in two launches:
every row's scores over its sequence's paged indexer keys, then its `topk` best positions.

Scores: score(r, t) = sum_h w_h(r) relu(q_h(r) . k_t * scale) for t <= the row's position p,
read straight from the pages through the row's block table (no gathered key tensor). One program
per (row, split); split s scores the key blocks s, s + SPLITS, ... up to p (every loop runs to
its row's position, a bound rather than a branch, so loads pipeline), so a captured decode
whose tables span max_model_len reads no more. An FP8 cache's keys are widened to the query's
dtype (e4m3 is exact in bf16) and its per-tensor scale folded into `scale` (relu commutes with
a positive factor). The dots multiply the dtype's values exactly and
sum in float32, as the torch path's float32 einsum of the same values.

Top-k: one program per row finds the k-th largest score by radix select (four passes of 8 bits
over the scores as order-preserving integers, a 256-bin histogram each, as the threshold
top-k of DeepGEMM-style indexers), then keeps every position above it and the earliest of those
equal to it: the set the torch path's stable descending sort keeps, ties included (the tiny
models tie at 0.0 wherever relu zeroes every head). Kept slots come in position order, -1 after.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_KEYS = 64  # keys a score step reads (not measured)
SPLITS = 32  # programs per row scoring keys (enough to fill an H200 at batch 8; not measured)
BLOCK_SCORES = 1024  # scores a top-k step reads
# Scratch scores held at once, [rows, positions] float32 (256 MiB): a long prefill is selected in
# row chunks of this many elements.
SCORE_ELEMENTS = 1 << 26


@triton.jit
def _scores_kernel(
    Q,  # [rows, heads, DIM]: the rotated index queries, in the model's dtype
    WEIGHTS,  # [rows, heads] float32: w_h, the head scale folded in
    KEYS,  # [slots, DIM]: the indexer key pages, flat
    TABLES,  # [rows, width] int64: each row's block table
    POSITIONS,  # [rows] int64
    REAL,  # [rows] bool
    SCORES,  # [rows, width * BLOCK] float32, written up to each row's position
    heads,
    width,
    scale,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,  # the cache's block size
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    r, split = tl.program_id(0), tl.program_id(1)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    live_d = d < DIM
    q = tl.load(
        Q + r.to(tl.int64) * heads * DIM + (h[:, None] * DIM + d[None, :]),
        mask=(h[:, None] < heads) & live_d[None, :],
        other=0.0,
    )
    w = tl.load(WEIGHTS + r * heads + h, mask=h < heads, other=0.0)
    p = tl.load(POSITIONS + r)
    last = tl.where(tl.load(REAL + r).to(tl.int1), p, -1)
    span = width * BLOCK
    # This split's key blocks up to the row's position: a loop bound, not a branch in the
    # loop, so the key loads pipeline.
    steps = ((last + BLOCK_T) // BLOCK_T - split + SPLITS - 1) // SPLITS
    for i in range(0, steps):
        t = (split + i * SPLITS) * BLOCK_T + tl.arange(0, BLOCK_T)
        seen = t <= last
        block = tl.load(TABLES + r * width + t // BLOCK, mask=seen, other=0)
        slot = block * BLOCK + t % BLOCK
        k = tl.load(
            KEYS + slot[:, None] * DIM + d[None, :],
            mask=seen[:, None] & live_d[None, :],
            other=0.0,
        ).to(q.dtype)
        dots = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_H, BLOCK_T]
        scores = tl.sum(tl.maximum(dots * scale, 0.0) * w[:, None], axis=0)
        tl.store(SCORES + r * span + t, scores, mask=seen)


@triton.jit
def _order_key(scores):
    """float32 -> int64 in [0, 2^32) in the same order; -0.0 as +0.0 (torch's sort ties them)."""
    bits = scores.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    bits = tl.where(bits == 0x80000000, 0, bits)
    return tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits + 0x80000000)


@triton.jit
def radix_threshold(ROW, count, TOPK: tl.constexpr, BLOCK_S: tl.constexpr):
    """Over the float32 scores ROW[0:count]: the order key of the TOPK-th largest (four 8-bit
    histogram passes, most significant digit first) and how many keys equal to it are kept
    (the earliest ones: the stable sort's set). Shared with v4_index_select.py."""
    bins = tl.arange(0, 256)
    threshold = tl.zeros((), dtype=tl.int64)
    known = tl.zeros((), dtype=tl.int64)  # the bits of the threshold found so far
    remaining = tl.full((), TOPK, dtype=tl.int64)  # how many of those matching them to keep
    steps = (count + BLOCK_S - 1) // BLOCK_S
    for digit in tl.static_range(4):
        shift = 24 - 8 * digit
        hist = tl.zeros([256], dtype=tl.int32)
        for i in range(0, steps):
            e = i * BLOCK_S + tl.arange(0, BLOCK_S)
            valid = e < count
            key = _order_key(tl.load(ROW + e, mask=valid, other=0.0))
            match = valid & ((key & known) == threshold)
            hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=match)
        hist = hist.to(tl.int64)
        at_or_above = tl.sum(hist) - tl.cumsum(hist, 0) + hist
        chosen = tl.max(tl.where(at_or_above >= remaining, bins, -1))
        remaining -= tl.sum(tl.where(bins > chosen, hist, 0))
        threshold |= chosen.to(tl.int64) << shift
        known |= 255 << shift
    return threshold, remaining


@triton.jit
def _top_kernel(
    SCORES,  # [rows, width * BLOCK] float32
    TABLES,  # [rows, width] int64
    POSITIONS,  # [rows] int64
    REAL,  # [rows] bool
    OUT,  # [rows, TOPK] int64: the kept cache slots, -1 after them
    width,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,  # the cache's block size
    BLOCK_S: tl.constexpr,
    BLOCK_O: tl.constexpr,
):
    r = tl.program_id(0)
    span = width * BLOCK
    p = tl.load(POSITIONS + r)
    last = tl.where(tl.load(REAL + r).to(tl.int1), p, -1)
    take_all = last + 1 <= TOPK  # no more visible positions than kept ones
    threshold, remaining = radix_threshold(SCORES + r * span, last + 1, TOPK, BLOCK_S)
    steps = (last + BLOCK_S) // BLOCK_S  # score blocks up to the row's position
    kept = tl.zeros((), dtype=tl.int64)
    equal_seen = tl.zeros((), dtype=tl.int64)
    for i in range(0, steps):
        t = i * BLOCK_S + tl.arange(0, BLOCK_S)
        valid = t <= last
        key = _order_key(tl.load(SCORES + r * span + t, mask=valid, other=0.0))
        equal = valid & (key == threshold)
        equal_rank = equal_seen + tl.cumsum(equal.to(tl.int64), 0) - 1
        keep = valid & (take_all | (key > threshold) | (equal & (equal_rank < remaining)))
        at = kept + tl.cumsum(keep.to(tl.int64), 0) - 1
        block = tl.load(TABLES + r * width + t // BLOCK, mask=keep, other=0)
        tl.store(OUT + r * TOPK + at, block * BLOCK + t % BLOCK, mask=keep)
        kept += tl.sum(keep.to(tl.int64))
        equal_seen += tl.sum(equal.to(tl.int64))
    for j in range(0, TOPK, BLOCK_O):
        o = j + tl.arange(0, BLOCK_O)
        tl.store(
            OUT + r * TOPK + o, tl.full([BLOCK_O], -1, tl.int64), mask=(o >= kept) & (o < TOPK)
        )


def supports(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """q [rows, heads, dim] in a float dtype, the key pages [blocks, B, 1, dim] in q's dtype or
    float8_e4m3fn, both contiguous."""
    return (
        q.dim() == 3
        and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and keys.dtype in (q.dtype, torch.float8_e4m3fn)
        and keys.dim() == 4
        and keys.shape[2] == 1
        and keys.shape[3] == q.shape[2]
        and q.is_contiguous()
        and keys.is_contiguous()
        and q.shape[1] <= 128
        and q.shape[2] <= 256
    )


def select(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    tables: torch.Tensor,
    positions: torch.Tensor,
    real: torch.Tensor,
    topk: int,
    scale: float,
) -> torch.Tensor:
    """-> [rows, topk] int64 cache slots (block * B + offset) of each row's kept positions, -1
    after them and for pad rows; `scale`: the score's, times an FP8 cache's per-tensor scale."""
    rows, heads, dim = q.shape
    block = keys.shape[1]
    width = tables.shape[1]
    span = width * block
    out = torch.empty(rows, topk, dtype=torch.int64, device=q.device)
    if rows == 0:
        return out
    tables, positions = tables.long().contiguous(), positions.long().contiguous()
    real, weights = real.contiguous(), weights.float().contiguous()
    chunk = max(1, SCORE_ELEMENTS // span)
    scores = torch.empty(min(rows, chunk), span, dtype=torch.float32, device=q.device)
    for lo in range(0, rows, chunk):
        hi = min(lo + chunk, rows)
        _scores_kernel[(hi - lo, SPLITS)](
            q[lo:hi],
            weights[lo:hi],
            keys,
            tables[lo:hi],
            positions[lo:hi],
            real[lo:hi],
            scores,
            heads,
            width,
            scale,
            DIM=dim,
            BLOCK=block,
            BLOCK_H=max(16, triton.next_power_of_2(heads)),
            BLOCK_D=max(16, triton.next_power_of_2(dim)),
            BLOCK_T=BLOCK_KEYS,
            SPLITS=SPLITS,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=8 if heads * dim > 4096 else 4,  # 64 heads of 128: a 16 KB q tile
        )
        _top_kernel[(hi - lo,)](
            scores,
            tables[lo:hi],
            positions[lo:hi],
            real[lo:hi],
            out[lo:hi],
            width,
            TOPK=topk,
            BLOCK=block,
            BLOCK_S=BLOCK_SCORES,
            BLOCK_O=min(1024, triton.next_power_of_2(topk)),
            num_warps=8,
        )
    return out
