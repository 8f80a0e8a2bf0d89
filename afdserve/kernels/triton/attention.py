"""Triton kernels for the paged KV cache: one-launch attention over every segment of a step, and a
KV write that skips pad rows on the device (no host sync).

Attention is split-K ("flash decoding"): program (segment, kv_head, query_block * splits + split)
attends one block of query rows x all query heads sharing that KV head over one slice of the
context and writes its partial output with its log-sum-exp; `combine_splits` merges the slices
(one split writes the final output directly). Where most segments' queries are far shorter than
the longest (a prefill chunk beside decodes; a mixed graph, launched for a query of the whole
batch in every segment) the grid is the step's query blocks instead, (block, kv_head, split),
each program finding its segment by a binary search over the query starts. A KV head's query
heads are folded into one tile's rows: a decode step feeds `tl.dot` at least 16 rows, each KV
tile read once per KV head. An FP8 cache is read without dequantizing: the tiles' bytes are
cast in registers to the dots' dtype (float16, exact for every e4m3 value; float32 for a float32
q), q is cast to it once (a bf16 q is exact unless |q| > 65504 or tiny), k_scale is folded into
the score scale and v_scale into the output's normalization (kernel arguments, so graphs
capture them): as exact as dequantizing, k * scale never rounded. Whole tiles run without token
masks, the partial last tile with them (K unmasked where the head dim needs no padding: tokens
past the slice get -inf). FP8 decode has its own launch (`FP8_DECODE_LAUNCH`). The KV write is
`reference.quantize_kv`'s.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from afdserve.kernels.metadata import AttentionMetadata

LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E)
BLOCK_N = 64  # context tokens per inner tile
MIN_TILE_ROWS = 16  # tl.dot needs at least 16 rows
# Split the context until about this many programs run per SM, and the kernel's launch shape:
# the fastest of a sweep over BLOCK_N 32/64/128, warps 4/8, stages 2/3/4 and 2/4/8 programs per
# SM, timed on an H200 at decode batch 1 and 64 with Qwen3-30B-A3B's heads and context 1024
# (docs/benchmarks.md, "Kernel choices: decode attention").
PROGRAMS_PER_SM = 2
WARPS, STAGES = 4, 3


@dataclass(frozen=True)
class Launch:
    """The attention kernel's launch constants (tools/attention_bench.py --sweep times others)."""

    block_n: int = BLOCK_N
    warps: int = WARPS
    stages: int = STAGES
    programs_per_sm: int = PROGRAMS_PER_SM
    maxnreg: int | None = None  # registers per thread ptxas may use (None: its own choice)
    # Query rows (positions x their group's heads) a prefill program takes; decode takes 16.
    prefill_rows: int = 64


# Decode over a cache of q's dtype, and prefill where `PREFILL_LAUNCH` does not apply.
DEFAULT_LAUNCH = Launch()
# Prefill and mixed steps over a cache of q's dtype, heads of up to `PREFILL_HEAD_DIM` channels:
# 128 query rows a program over 32-token tiles, the fastest of `tools/attention_bench.py --prefill
# 8x1024,2x4096 --sweep` on an H100 (309 against 355 us at 8 x 1024, 976 against 1101 at 2 x 4096;
# docs/benchmarks.md, 2026-12-07). Others keep `DEFAULT_LAUNCH` (64 rows): over an FP8 cache
# the 128 rows spill in the loop (its dequantized tiles live beside them; tests/kernels/
# test_attention_compile.py), and 128 rows of a float32 accumulator 256 channels wide would not
# fit 4 warps' registers.
PREFILL_LAUNCH = Launch(block_n=32, prefill_rows=128)
PREFILL_HEAD_DIM = 128
# The flat grid (module docstring) from this many times the programs of a segment's grid over
# the flat one's (0: never). Decode (one query row a segment) keeps the segment grid: its
# programs would pay the binary search's dependent loads for no empty program saved.
FLAT_RATIO = 2
# Decode over an FP8 cache. Up to 4 stages Triton's pipeliner (3.6) issues a tile's K/V copies
# one iteration ahead and waits for all of them at the loop top (async_wait num=0), so a
# program's loads never overlap its own compute: an SM has its 4 programs x one tile in flight,
# and an FP8 tile is half a bf16 one's bytes, hence the same tokens per second as bf16. 5 stages
# keep the next tile's copies in flight through the current tile's compute (num=3). Capped at
# 128 registers (168 uncapped; capped, 3 values that live across the loop spill, stored once
# before it and loaded once after, none inside) so 4 programs fit an SM as at bf16, and 2
# per SM planned keeps every batch's programs in one wave (tests/kernels/
# test_attention_compile.py checks all of this on the SASS).
FP8_DECODE_LAUNCH = Launch(block_n=64, warps=4, stages=5, programs_per_sm=2, maxnreg=128)
# Heads padded to 512 channels or more (MLA's latent read whole, 576 wide in Kimi-Linear's NoPE
# layers, padded to 1024): the default 64-token tiles over 3 stages ask 332 KB of shared memory
# at decode, past sm_90's 227 KiB (OutOfResources on an H100); 32 tokens over 2 stages and at
# most 32 query rows a program ask 199 KB (tests/kernels/test_attention_compile.py).
WIDE_HEAD_DIM = 512
WIDE_LAUNCH = Launch(block_n=32, warps=8, stages=2)
WIDE_TILE_ROWS = 32


def wide_head(dim: int) -> bool:
    return triton.next_power_of_2(dim) >= WIDE_HEAD_DIM


def query_block(decode: bool, group_pad: int, dim: int, prefill_rows: int = 64) -> int:
    """Query positions a program takes (each with its group's heads): 16 rows at decode,
    `prefill_rows` in prefill, 32 at most for wide heads."""
    rows = MIN_TILE_ROWS if decode else prefill_rows
    if wide_head(dim):
        rows = min(rows, WIDE_TILE_ROWS)
    return max(1, rows // group_pad)


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    start,
    hi,
    pos,
    kv_base,
    strides,
    dims,
    dim_ok,
    qk_scale_log2,
    window,
    CACHE_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    IEEE: tl.constexpr,
    FP8_KV: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """One online-softmax step over the tile of tokens from `start`. MASKED: some tokens may be
    >= hi (else none are, and no load or score needs a mask); CAUSAL: some rows' positions may
    precede a token (else, as in decode, every row sees the whole slice); with HAS_WINDOW a row
    at p also sees no token at or before p - window (rows of one tile start the slice at the
    first row's window, so later rows mask its head)."""
    K, V, table, k_head, v_head = kv_base
    stride_kb, stride_kt, stride_vb, stride_vt = strides
    tok = start + tl.arange(0, BLOCK_N)
    tok_ok = tok < hi
    if MASKED:
        block = tl.load(table + tok // CACHE_BLOCK, mask=tok_ok, other=0).to(tl.int64)
    else:
        block = tl.load(table + tok // CACHE_BLOCK).to(tl.int64)
    offset = tok % CACHE_BLOCK
    kv_mask = tok_ok[:, None] & dim_ok[None, :]
    k_ptrs = K + (block * stride_kb + offset * stride_kt + k_head)[:, None] + dims[None, :]
    v_ptrs = V + (block * stride_vb + offset * stride_vt + v_head)[:, None] + dims[None, :]
    if FP8_KV and DIM_PAD == HEAD_DIM:
        # K unmasked: a token past `hi` reads block 0 (its table entry loads as 0), a real
        # address, and its score is replaced by -inf below whatever the bytes hold.
        k = tl.load(k_ptrs)
    elif MASKED:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptrs, mask=dim_ok[None, :], other=0.0)
    if MASKED:  # V's bytes past `hi` may be NaN, and 0 * NaN is NaN: masked to 0
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    else:
        v = tl.load(v_ptrs, mask=dim_ok[None, :], other=0.0)
    if FP8_KV:  # exact casts; k_scale is in qk_scale_log2, v_scale applied to the output
        k = k.to(DOT_DTYPE)
        v = v.to(DOT_DTYPE)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale_log2
    if MASKED and CAUSAL:
        s = tl.where(tok_ok[None, :] & (tok[None, :] <= pos[:, None]), s, float("-inf"))
    elif MASKED:
        s = tl.where(tok_ok[None, :], s, float("-inf"))
    elif CAUSAL:
        s = tl.where(tok[None, :] <= pos[:, None], s, float("-inf"))
    if CAUSAL and HAS_WINDOW:
        s = tl.where(tok[None, :] > pos[:, None] - window, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    Q,
    K,
    V,
    Out,
    OPart,
    LSE,
    Sinks,
    block_tables,
    query_start,
    context_lens,
    qk_scale_log2,
    v_scale,
    window,
    stride_qr,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_or,
    stride_oh,
    stride_pr,
    stride_ph,
    stride_ps,
    stride_lr,
    stride_lh,
    stride_bt,
    split_tokens,
    num_splits,
    num_segments,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    IEEE: tl.constexpr,
    FP8_KV: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    FLAT: tl.constexpr = False,
):
    kv_head = tl.program_id(1)
    if FLAT:  # program_id(0) is a query block of the step (`flat_blocks`), (2) the split
        block = tl.program_id(0)
        split = tl.program_id(2)
        # Segment i owns blocks from start(i) = query_start[i] // BLOCK_Q + i, increasing in i
        # (cdiv(q_len, BLOCK_Q) of them at most, and one for an empty segment): the block's
        # segment is the last whose start is at or before it.
        seg = 0
        right = num_segments
        while right - seg > 1:
            mid = (seg + right) // 2
            if tl.load(query_start + mid) // BLOCK_Q + mid <= block:
                seg = mid
            else:
                right = mid
        q_block = block - (tl.load(query_start + seg) // BLOCK_Q + seg)
    else:
        seg = tl.program_id(0)
        q_block = tl.program_id(2) // num_splits
        split = tl.program_id(2) % num_splits

    row_lo = tl.load(query_start + seg)
    row_hi = tl.load(query_start + seg + 1)
    q_len = row_hi - row_lo
    if q_block * BLOCK_Q >= q_len:
        return
    ctx = tl.load(context_lens + seg)

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    m_idx = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + m_idx // GROUP_PAD  # query row within the segment
    head = kv_head * GROUP + m_idx % GROUP_PAD
    row_ok = (q_idx < q_len) & (m_idx % GROUP_PAD < GROUP)
    pos = ctx - q_len + q_idx  # absolute position of each query row
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM

    q_ptrs = Q + (row_lo + q_idx)[:, None] * stride_qr + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if FP8_KV:  # the dots' dtype (float16 for a bfloat16 q: e4m3 -> f16 is one cvt per 2 values)
        q = q.to(DOT_DTYPE)

    # Keys this program may need: its context slice, cut at the block's last query position.
    last_pos = ctx - q_len + tl.minimum((q_block + 1) * BLOCK_Q, q_len) - 1
    lo = split * split_tokens
    if HAS_WINDOW:  # the splits start at the first key the block's first row sees
        lo += tl.maximum(ctx - q_len + q_block * BLOCK_Q - window + 1, 0)
    hi = tl.minimum(tl.minimum(lo + split_tokens, ctx), last_pos + 1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table = block_tables + seg * stride_bt
    # Each tile: K/V rows of the program's KV head at the tile's tokens, through the table.
    kv_base = (K, V, table, kv_head * stride_kh, kv_head * stride_vh)
    strides = (stride_kb, stride_kt, stride_vb, stride_vt)
    if FP8_KV:
        # Whole tiles without masks (every token < hi), then the partial one, masked.
        full_hi = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
        for start in range(lo, full_hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q,
                m_i,
                l_i,
                acc,
                start,
                hi,
                pos,
                kv_base,
                strides,
                dims,
                dim_ok,
                qk_scale_log2,
                window,
                CACHE_BLOCK,
                BLOCK_N,
                HEAD_DIM,
                DIM_PAD,
                IEEE,
                FP8_KV,
                DOT_DTYPE,
                False,
                CAUSAL,
                HAS_WINDOW,
            )
        if full_hi < hi:
            m_i, l_i, acc = _attend_tile(
                q,
                m_i,
                l_i,
                acc,
                full_hi,
                hi,
                pos,
                kv_base,
                strides,
                dims,
                dim_ok,
                qk_scale_log2,
                window,
                CACHE_BLOCK,
                BLOCK_N,
                HEAD_DIM,
                DIM_PAD,
                IEEE,
                FP8_KV,
                DOT_DTYPE,
                True,
                CAUSAL,
                HAS_WINDOW,
            )
    else:
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q,
                m_i,
                l_i,
                acc,
                start,
                hi,
                pos,
                kv_base,
                strides,
                dims,
                dim_ok,
                qk_scale_log2,
                window,
                CACHE_BLOCK,
                BLOCK_N,
                HEAD_DIM,
                DIM_PAD,
                IEEE,
                FP8_KV,
                DOT_DTYPE,
                True,
                True,
                HAS_WINDOW,
            )

    if HAS_SINKS and DIRECT:  # the sink's mass joins the denominator, with no value (split:
        # `combine_splits` adds it once)
        sink = tl.load(Sinks + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E_C
        m_all = tl.maximum(m_i, sink)
        rescale = tl.exp2(m_i - m_all)
        l_i = l_i * rescale + tl.exp2(sink - m_all)
        acc = acc * rescale[:, None]
    has = l_i > 0.0
    denom = tl.where(has, l_i, 1.0)
    if FP8_KV:
        denom = denom / v_scale  # acc * v_scale / l_i: V's scale once per row, not per value
    out = tl.where(has[:, None], acc / denom[:, None], 0.0)
    rows = row_lo + q_idx
    store_mask = row_ok[:, None] & dim_ok[None, :]
    if DIRECT:
        o_ptrs = Out + rows[:, None] * stride_or + head[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=store_mask)
    else:
        p_ptrs = (
            OPart
            + rows[:, None] * stride_pr
            + head[:, None] * stride_ph
            + split * stride_ps
            + dims[None, :]
        )
        tl.store(p_ptrs, out, mask=store_mask)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(LSE + rows * stride_lr + head * stride_lh + split, lse, mask=row_ok)


def flat_blocks(rows: int, segments: int, block_q: int) -> int:
    """Query blocks of a step of `rows` query rows in `segments` (the flat grid's programs along
    its first axis): each segment's rows in blocks of `block_q` from its own first row, so at
    most one partial block a segment beyond rows // block_q (an empty segment takes one)."""
    return rows // block_q + segments


@functools.cache
def _sm_count(device: torch.device) -> int:
    """The SMs the splits fill; 1 off CUDA (Triton's interpreter, which runs programs in turn)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device.index or 0).multi_processor_count


def plan_splits(
    segments: int,
    kv_heads: int,
    q_blocks: int,
    max_context: int,
    sm_count: int,
    launch: Launch = DEFAULT_LAUNCH,
) -> tuple[int, int]:
    """(splits, tokens per split): enough programs to fill the GPU, each slice whole tiles."""
    tiles = max(1, triton.cdiv(max_context, launch.block_n))
    programs = max(1, segments * kv_heads * q_blocks)
    splits = max(1, min(tiles, triton.cdiv(launch.programs_per_sm * sm_count, programs)))
    tiles_per_split = triton.cdiv(tiles, splits)
    splits = triton.cdiv(tiles, tiles_per_split)
    return splits, tiles_per_split * launch.block_n


@triton.jit
def _combine_kernel(
    Parts,
    LSE,
    Out,
    covered_ptr,
    Sinks,
    stride_pr,
    stride_ph,
    stride_ps,
    stride_lr,
    stride_lh,
    stride_or,
    stride_oh,
    num_splits,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Out[row, head] = the slices' partial outputs weighted by their share of the softmax mass
    (with HAS_SINKS, of the mass with the head's sink logit: a share that goes to no value).
    A slice with no keys has lse -inf: weight 0, and its partial output is not read at all, so
    `Parts` needs no zero fill. Rows from `covered_ptr`'s value on (the segments' total: graph
    padding, which no program of the attention kernel writes) come out zero without reading
    `LSE`, so it needs no fill either."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.arange(0, SPLITS_PAD)
    covered = split * 0 + row < tl.load(covered_ptr)  # (broadcast: the interpreter's masks)
    lse = tl.load(
        LSE + row * stride_lr + head * stride_lh + split,
        mask=(split < num_splits) & covered,
        other=float("-inf"),
    )
    top = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(Sinks + head).to(tl.float32) * LOG2E_C
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(lse - top)
    total = tl.sum(weight, axis=0)
    if HAS_SINKS:
        total += tl.exp2(sink - top)
    weight = weight / tl.maximum(total, 1e-30)
    dims = tl.arange(0, DIM_PAD)
    has = lse > float("-inf")
    parts = tl.load(
        Parts + row * stride_pr + head * stride_ph + split[:, None] * stride_ps + dims[None, :],
        mask=has[:, None] & (dims < HEAD_DIM)[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weight[:, None], axis=0)
    tl.store(
        Out + row * stride_or + head * stride_oh + dims,
        out.to(Out.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def combine_splits(
    parts: torch.Tensor,
    lse: torch.Tensor,
    out_dtype: torch.dtype,
    covered: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """parts [rows, heads, splits, dim] float32, lse [rows, heads, splits] (log2 units), both
    written for the rows before `covered`'s one int32 value (the rows the segments cover); the
    rows from it on come out zero. `sinks` [heads]: each head's sink logit (natural units)."""
    rows, heads, splits, dim = parts.shape
    out = torch.empty(rows, heads, dim, dtype=out_dtype, device=parts.device)
    if rows:
        _combine_kernel[(rows, heads)](
            parts,
            lse,
            out,
            covered,
            lse if sinks is None else sinks,
            *parts.stride()[:3],
            *lse.stride()[:2],
            *out.stride()[:2],
            splits,
            SPLITS_PAD=triton.next_power_of_2(splits),
            HEAD_DIM=dim,
            DIM_PAD=triton.next_power_of_2(dim),
            HAS_SINKS=sinks is not None,
        )
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    launch: Launch | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Same contract as `reference.paged_attention`; needs `meta.batched`. q [rows, heads, dim].
    The caches are both q's dtype, or both float8_e4m3fn (read with k_scale / v_scale).
    With a `window` the splits cover a query block's windows, not the whole context.
    `launch`: the kernel's launch constants (default: `FP8_DECODE_LAUNCH` for decode over an FP8
    cache, `PREFILL_LAUNCH` for longer queries over a cache of q's dtype and heads up to
    `PREFILL_HEAD_DIM` channels, `WIDE_LAUNCH` for wide heads, else `DEFAULT_LAUNCH`); only
    benchmarks pass it."""
    batched = meta.batched
    assert batched is not None, "the Triton path needs meta.batched (filled for CUDA steps)"
    rows, heads, dim = q.shape
    kv_heads, cache_block = k_cache.shape[2], k_cache.shape[1]
    if v_cache.shape[-1] != dim or k_cache.shape[-1] != dim:
        raise ValueError(f"head dims differ: q {dim}, k {k_cache.shape[-1]}, v {v_cache.shape[-1]}")
    fp8_kv = k_cache.dtype == torch.float8_e4m3fn
    if (v_cache.dtype == torch.float8_e4m3fn) != fp8_kv:
        raise ValueError(f"k cache {k_cache.dtype}, v cache {v_cache.dtype}: FP8 both or neither")
    group = heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    decode = batched.max_query_len <= 1
    segments = int(batched.context_lens.shape[0])
    if segments == 0 or batched.max_context_len == 0:
        return torch.zeros(rows, heads, dim, dtype=q.dtype, device=q.device)
    if launch is None and wide_head(dim):
        launch = WIDE_LAUNCH
    elif launch is None:
        launch = FP8_DECODE_LAUNCH if fp8_kv and decode else DEFAULT_LAUNCH
        if not (decode or fp8_kv) and triton.next_power_of_2(dim) <= PREFILL_HEAD_DIM:
            launch = PREFILL_LAUNCH
    block_q = query_block(decode, group_pad, dim, launch.prefill_rows)
    q_blocks = triton.cdiv(max(batched.max_query_len, 1), block_q)
    blocks = flat_blocks(rows, segments, block_q)
    # A grid of segments x their longest query's blocks, or of the step's query blocks where
    # that one would be more than FLAT_RATIO times as many programs (a mixed step: one long
    # prefill chunk beside many decodes; a mixed graph, launched for every row a segment with
    # the whole batch as its query): most of its programs would find no rows and end.
    flat = FLAT_RATIO > 0 and segments * q_blocks > FLAT_RATIO * blocks
    span = batched.max_context_len
    if window is not None:  # the keys one query block can see
        span = min(span, window + block_q - 1)
    splits, split_tokens = plan_splits(
        1 if flat else segments,
        kv_heads,
        blocks if flat else q_blocks,
        span,
        _sm_count(q.device),
        launch,
    )
    direct = splits == 1
    if direct:
        # Rows no segment covers (graph padding) are never written by the kernel: zero them.
        # Where the host's segments span every row (an eager step; the kernel reads segment i's
        # rows as [query_start[i], query_start[i + 1]), so they run back to back) every row is
        # written, and the fill (a prefill step's whole output) is skipped. A graph's
        # static metadata has no host segments: it zeroes.
        spans = meta.segments
        covered = bool(spans) and spans[0].row_start == 0 and spans[-1].row_end == rows
        alloc = torch.empty if covered else torch.zeros
        out = alloc(rows, heads, dim, dtype=q.dtype, device=q.device)
        parts = lse = out  # unused placeholders
        part_strides, lse_strides = (0, 0, 0), (0, 0)
    else:
        out = q  # unused placeholder: combine_splits writes the output
        # Every slice of a covered row writes its lse (rows past the segments' total are
        # padding, which combine_splits zeroes without reading them).
        parts = torch.empty(rows, heads, splits, dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(rows, heads, splits, device=q.device)
        part_strides, lse_strides = parts.stride()[:3], lse.stride()[:2]
    tables = batched.block_tables
    qk_scale_log2 = scale * LOG2E * (float(k_scale) if fp8_kv else 1.0)
    grid = (blocks, kv_heads, splits) if flat else (segments, kv_heads, q_blocks * splits)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        parts,
        lse,
        q if sinks is None else sinks,  # unused placeholder without sinks
        tables,
        batched.query_start,
        batched.context_lens,
        qk_scale_log2,
        float(v_scale),
        0 if window is None else int(window),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        *part_strides,
        *lse_strides,
        tables.stride(0),
        split_tokens,
        splits,
        segments,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        HEAD_DIM=dim,
        DIM_PAD=triton.next_power_of_2(dim),
        CACHE_BLOCK=cache_block,
        BLOCK_N=launch.block_n,
        DIRECT=direct,
        IEEE=q.dtype == torch.float32,
        FP8_KV=fp8_kv,
        DOT_DTYPE=tl.float32 if q.dtype == torch.float32 else tl.float16,
        CAUSAL=not (fp8_kv and decode),
        HAS_SINKS=sinks is not None,
        HAS_WINDOW=window is not None,
        FLAT=flat,
        num_warps=launch.warps,
        num_stages=launch.stages,
        **({} if launch.maxnreg is None else {"maxnreg": launch.maxnreg}),
    )
    if direct:
        return out
    return combine_splits(parts, lse, q.dtype, batched.query_start[segments:], sinks)


@triton.jit
def quantize_fp8(x, scale, DST: tl.constexpr):
    """`reference.quantize_kv` on a tile: x / scale in float32, correctly rounded (Triton's `/` is
    approximate), clamped to +-448 (e4m3fn's largest finite value), cast to nearest even."""
    y = tl.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    return y.to(DST, fp_downcast_rounding="rtne")


@triton.jit
def _write_kv_kernel(
    Cache, Values, slots, stride_vr, width, scale, BLOCK: tl.constexpr, FP8_KV: tl.constexpr
):
    row = tl.program_id(0)
    slot = tl.load(slots + row)
    cols = tl.arange(0, BLOCK)
    mask = (cols < width) & (slot >= 0)
    vals = tl.load(Values + row * stride_vr + cols, mask=mask)
    if FP8_KV:
        vals = quantize_fp8(vals, scale, Cache.dtype.element_ty)
    tl.store(Cache + slot.to(tl.int64) * width + cols, vals.to(Cache.dtype.element_ty), mask=mask)


def write_kv(
    cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor, scale: float = 1.0
) -> None:
    """cache [blocks, block_size, *shape] (contiguous); values [rows, *shape]; slot -1 skipped.
    `scale`: an FP8 cache's per-tensor scale."""
    rows = values.shape[0]
    if rows == 0:
        return
    width = cache[0, 0].numel()
    flat = values.reshape(rows, width)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    _write_kv_kernel[(rows,)](
        cache,
        flat,
        slot_mapping,
        flat.stride(0),
        width,
        float(scale),
        BLOCK=triton.next_power_of_2(width),
        FP8_KV=cache.dtype == torch.float8_e4m3fn,
    )
