"""DeepSeek Sparse Attention's MLA over each row's selected latent rows (model/families/dsa/
attention.py's `_attend`) in one launch, read straight from the paged latent cache by slot (no
gathered [rows, topk, latent] tensor).

Absorbed MLA is MQA with K = V: every head attends over the same cached rows [latent, rope key],
its query the latent-space one, and the values are the rows' latent part. So, as FlashMLA's sparse
decode, a program takes one row and a block of heads and each tile of selected rows it loads feeds
both dots of all those heads. The score splits into its latent and rope parts (two dots, so
neither width need be a power of two as a whole: 512 + 64 in the real models). Softmax online in
float32; each row's loop ends at its last selected slot, -1s before it masked, and a row that
selected nothing (a pad row) gives zeros, as the torch path. Prefill rows are rows like any
other: each has its own selection. An FP8 cache's rows are widened to the query's dtype times
the per-tensor scale, as `dequantize_kv` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Selected rows per tile (tl.dot's minimum K for the probabilities' product; not measured).
BLOCK_ROWS = 32


@triton.jit
def _sparse_mla_kernel(
    Q,  # [rows, heads, LATENT + ROPE]: the absorbed queries
    CACHE,  # [slots, LATENT + ROPE]: the latent pages, flat
    SELECTED,  # [rows, TOPK] int64 cache slots, -1 for none
    SCAN,  # [rows] int64: how many leading entries hold every selected slot
    OUT,  # [rows, heads, LATENT]
    heads,
    scale,
    k_scale,
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    TOPK: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    r, head_block = tl.program_id(0), tl.program_id(1)
    width: tl.constexpr = LATENT + ROPE
    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    lat = tl.arange(0, BLOCK_L)
    rot = tl.arange(0, BLOCK_R)
    live_h = h < heads
    # 64-bit rows: 128 heads of 576 is 73728 elements a token, 2^31 past 29127 tokens a step.
    q_rows = Q + r.to(tl.int64) * heads * width + h[:, None] * width
    q_lat = tl.load(
        q_rows + lat[None, :], mask=live_h[:, None] & (lat < LATENT)[None, :], other=0.0
    )
    q_rot = tl.load(
        q_rows + LATENT + rot[None, :], mask=live_h[:, None] & (rot < ROPE)[None, :], other=0.0
    )
    # A finite start, so a tile masked whole leaves the running max (and alpha = 1) alone.
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)
    for t in range(0, tl.load(SCAN + r), BLOCK_N):
        slot = tl.load(SELECTED + r * TOPK + t + n, mask=t + n < TOPK, other=-1)
        valid = slot >= 0
        rows = CACHE + tl.where(valid, slot, 0)[:, None] * width
        k_lat = tl.load(
            rows + lat[None, :], mask=valid[:, None] & (lat < LATENT)[None, :], other=0.0
        )
        k_rot = tl.load(
            rows + LATENT + rot[None, :],
            mask=valid[:, None] & (rot < ROPE)[None, :],
            other=0.0,
        )
        if FP8:
            k_lat = (k_lat.to(tl.float32) * k_scale).to(q_lat.dtype)
            k_rot = (k_rot.to(tl.float32) * k_scale).to(q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)
        s += tl.dot(q_rot, tl.trans(k_rot), input_precision=PRECISION)
        s = tl.where(valid[None, :], s * scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pv = tl.dot(p.to(k_lat.dtype), k_lat, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
    tl.store(
        OUT + r.to(tl.int64) * heads * LATENT + (h[:, None] * LATENT + lat[None, :]),
        out.to(OUT.dtype.element_ty),
        mask=live_h[:, None] & (lat < LATENT)[None, :],
    )


def supports(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """q [rows, heads, dim] in a float dtype, the pages [blocks, B, 1, dim] in q's dtype or
    float8_e4m3fn, both contiguous."""
    return (
        q.dim() == 3
        and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and cache.dtype in (q.dtype, torch.float8_e4m3fn)
        and cache.dim() == 4
        and cache.shape[2] == 1
        and cache.shape[3] == q.shape[2]
        and q.is_contiguous()
        and cache.is_contiguous()
        and q.shape[2] <= 1024
    )


def sparse_mla(
    q: torch.Tensor,
    cache: torch.Tensor,
    selected: torch.Tensor,
    latent: int,
    scale: float,
    k_scale: float,
) -> torch.Tensor:
    """q [rows, heads, latent + rope], selected [rows, topk] slots -> the attention's latent
    part [rows, heads, latent] in q's dtype (zeros for a row of no selected slot)."""
    rows, heads, dim = q.shape
    topk = selected.shape[1]
    out = torch.empty(rows, heads, latent, dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    # 32 heads keep a [32, 512] float32 output, a [32, 576] query and the pipelined row tiles
    # in eight warps without spilling (FlashMLA takes 64 over two warpgroups); an FP8 cache's
    # widened tiles spill there, so 16 (tests/kernels/test_dsa_compile.py; not measured).
    fp8 = cache.dtype == torch.float8_e4m3fn
    block_h = 16 if heads <= 16 or fp8 else 32
    selected = selected.long().contiguous()
    # Each row's loop ends past its last selected slot (the selections put their -1 last, so
    # a short context's row reads only its tiles), a bound rather than a branch, so the
    # gathered loads pipeline.
    place = torch.arange(1, topk + 1, device=selected.device)
    scan = torch.where(selected >= 0, place, 0).amax(1) if topk else selected.new_zeros(rows)
    _sparse_mla_kernel[(rows, triton.cdiv(heads, block_h))](
        q,
        cache,
        selected,
        scan,
        out,
        heads,
        scale,
        k_scale,
        LATENT=latent,
        ROPE=dim - latent,
        TOPK=topk,
        FP8=fp8,
        BLOCK_H=block_h,
        BLOCK_N=BLOCK_ROWS,
        BLOCK_L=max(16, triton.next_power_of_2(latent)),
        BLOCK_R=max(16, triton.next_power_of_2(dim - latent)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=8 if latent > 128 else 4,
    )
    return out
