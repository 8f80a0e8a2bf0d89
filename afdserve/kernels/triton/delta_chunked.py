"""The gated delta rule's chunked form over varlen spans as one Triton launch: the prefill rows of
a step, each span from its slot's state, its final state written back. Same math as
kernels/reference/delta_chunked.py (its docstring derives it), float32 throughout.

A program holds one span's value head and a block of its value channels: the state tile
[dk, BV] stays in registers while the program walks the span's chunks of C rows in order. Per
chunk the unit lower-triangular system I + A (A[i, j] = beta_i e^(G_i - G_j) k_i . k_j, j < i)
is inverted by forward substitution in registers, after which everything is a matrix product:
W = T (beta e^G K), U = T (beta V) - W S, O = (e^G Q) S + (Q K^T * decay) U, and
S <- e^(G_last) S + (e^(G_last - G) K)^T U. With a decay per key channel (Kimi) the pairwise
decays differ per channel, so A and the scores are summed channel by channel, each pair's
e^(G_i - G_j) taken directly (never as e^G_i e^-G_j, which overflows over a long chunk).
No host sync: the spans are read on the device, a span of slot -1 (the pad marker of a table
sized by capacity, as a CUDA graph's) skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 32


@triton.jit
def _unit_lower_inverse(a, rc, C: tl.constexpr):
    """(I + a)^-1 of a strictly lower-triangular [C, C] a, row by row: T_i = e_i - a_i T."""
    inv = tl.where(rc[:, None] == rc[None, :], 1.0, 0.0)
    for i in range(1, C):
        a_i = tl.sum(tl.where(rc[:, None] == i, a, 0.0), axis=0)  # [C]: a's row i
        row = tl.sum(a_i[:, None] * inv, axis=0)  # only rows j < i of inv, all final
        inv = tl.where(rc[:, None] == i, inv - row[None, :], inv)
    return inv


@triton.jit
def _pairs_per_channel(Q, K, G, q_at, g_at, live, q_norm, k_norm, causal, dk, C: tl.constexpr):
    """(sum_c k_ic k_jc e^(G_ic - G_jc), sum_c q_ic k_jc e^(G_ic - G_jc)) for j <= i: [C, C] each.
    q_at, g_at [C]: the chunk's row offsets into Q / K and G at channel 0."""
    kk = tl.zeros((C, C), dtype=tl.float32)
    qk = tl.zeros((C, C), dtype=tl.float32)
    for c in range(0, dk):
        kc = tl.load(K + q_at + c, mask=live, other=0.0).to(tl.float32) * k_norm
        qc = tl.load(Q + q_at + c, mask=live, other=0.0).to(tl.float32) * q_norm
        gc = tl.cumsum(tl.load(G + g_at + c, mask=live, other=0.0), axis=0)
        pair = tl.where(causal, tl.exp(gc[:, None] - gc[None, :]), 0.0)
        kk += kc[:, None] * kc[None, :] * pair
        qk += qc[:, None] * kc[None, :] * pair
    return kk, qk


@triton.jit
def _chunks_kernel(
    Q,  # [rows, hk, dk], row stride stride_q
    K,  # [rows, hk, dk], row stride stride_q
    V,  # [rows, hv, dv], row stride stride_v
    G,  # [rows, hv] or [rows, hv, dk] float32
    BETA,  # [rows, hv] float32
    S,  # [slots, hv, dk, dv] float32, slot stride stride_s
    SPANS,  # [n, 4] int32: row_start, row_end, state_slot, fresh
    OUT,  # [rows, hv, dv]
    stride_q,
    stride_v,
    stride_s,
    hv,
    group,  # value heads per key head
    dk,
    dv,
    scale,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
):
    span, head, vblock = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kh = head // group
    r0 = tl.load(SPANS + span * 4)
    slot = tl.load(SPANS + span * 4 + 2).to(tl.int64)
    active = slot >= 0  # slot -1: the pad marker, a span of no rows, no state read or written
    r1 = tl.where(active, tl.load(SPANS + span * 4 + 1), r0)
    fresh = tl.load(SPANS + span * 4 + 3)
    rc = tl.arange(0, C)
    rk = tl.arange(0, BK)
    rv = vblock * BV + tl.arange(0, BV)
    mk, mv = rk < dk, rv < dv
    base = S + tl.maximum(slot, 0) * stride_s + head * dk * dv
    tile = rk[:, None] * dv + rv[None, :]
    s_mask = mk[:, None] & mv[None, :] & active
    s = tl.load(base + tile, mask=s_mask, other=0.0)  # [BK, BV]
    s = tl.where(fresh != 0, 0.0, s)
    lower = rc[:, None] > rc[None, :]
    causal = rc[:, None] >= rc[None, :]
    for c0 in range(r0, r1, C):
        rows = (c0 + rc).to(tl.int64)
        live = rows < r1
        q_at = rows * stride_q + kh * dk  # [C]
        qk_mask = live[:, None] & mk[None, :]
        q = tl.load(Q + q_at[:, None] + rk[None, :], mask=qk_mask, other=0.0).to(tl.float32)
        k = tl.load(K + q_at[:, None] + rk[None, :], mask=qk_mask, other=0.0).to(tl.float32)
        q_norm = scale / tl.sqrt(tl.sum(q * q, axis=1) + 1e-6)  # [C]
        k_norm = 1.0 / tl.sqrt(tl.sum(k * k, axis=1) + 1e-6)
        q = q * q_norm[:, None]
        k = k * k_norm[:, None]
        v_at = rows * stride_v + head * dv
        v_mask = live[:, None] & mv[None, :]
        v = tl.load(V + v_at[:, None] + rv[None, :], mask=v_mask, other=0.0).to(tl.float32)
        beta = tl.load(BETA + rows * hv + head, mask=live, other=0.0)  # 0 on pad rows
        if PER_CHANNEL:
            g_at = (rows * hv + head) * dk
            g = tl.load(G + g_at[:, None] + rk[None, :], mask=qk_mask, other=0.0)
            cum = tl.cumsum(g, axis=0)  # [C, BK]; pad rows add 0, so the last row is the end
            end = tl.sum(tl.where(rc[:, None] == C - 1, cum, 0.0), axis=0)  # [BK]
            kk, scores = _pairs_per_channel(
                Q, K, G, q_at, g_at, live, q_norm, k_norm, causal, dk, C
            )
            system = tl.where(lower, kk, 0.0) * beta[:, None]
            q_decayed = q * tl.exp(cum)
            k_decayed = k * tl.exp(cum)
            k_to_end = k * tl.exp(end[None, :] - cum)
            end_decay = tl.exp(end)[:, None]  # [BK, 1]: each row of S its own decay
        else:
            g = tl.load(G + rows * hv + head, mask=live, other=0.0)
            cum = tl.cumsum(g, axis=0)  # [C]
            end = tl.sum(tl.where(rc == C - 1, cum, 0.0), axis=0)
            decay = tl.where(causal, tl.exp(cum[:, None] - cum[None, :]), 0.0)  # [C, C]
            kk = tl.dot(k, tl.trans(k), input_precision="ieee")
            system = tl.where(lower, kk * decay, 0.0) * beta[:, None]
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * decay
            q_decayed = q * tl.exp(cum)[:, None]
            k_decayed = k * tl.exp(cum)[:, None]
            k_to_end = k * tl.exp(end - cum)[:, None]
            end_decay = tl.exp(end)
        inv = _unit_lower_inverse(system, rc, C)
        w = tl.dot(inv, k_decayed * beta[:, None], input_precision="ieee")  # [C, BK]
        u = tl.dot(inv, v * beta[:, None], input_precision="ieee")  # [C, BV]
        u -= tl.dot(w, s, input_precision="ieee")
        o = tl.dot(q_decayed, s, input_precision="ieee")
        o += tl.dot(scores, u, input_precision="ieee")
        o_at = (rows * hv + head) * dv
        tl.store(OUT + o_at[:, None] + rv[None, :], o.to(OUT.dtype.element_ty), mask=v_mask)
        s = s * end_decay + tl.dot(tl.trans(k_to_end), u, input_precision="ieee")
    tl.store(base + tile, s, mask=s_mask)


def _rows_of_heads(t: torch.Tensor) -> torch.Tensor:
    """t [rows, heads, d] with heads and channels packed (a row stride of its own is fine)."""
    if t.stride(2) == 1 and t.stride(1) == t.shape[2]:
        return t
    return t.contiguous()


def chunked_spans(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    spans: torch.Tensor,
    out: torch.Tensor,
    chunk: int = CHUNK,
) -> None:
    """As reference.delta_chunked.chunked_spans (its docstring has the shapes); states float32,
    each slot contiguous (the slots at any stride), out contiguous. `chunk`: rows per step of a
    span (a power of two >= 16)."""
    n = spans.shape[0]
    hv, dv, dk = v.shape[1], v.shape[2], k.shape[2]
    if n == 0:
        return
    q, v = _rows_of_heads(q), _rows_of_heads(v)
    k = k if k.stride() == q.stride() else k.contiguous()
    if k.stride() != q.stride():
        q = q.contiguous()
    bk = max(16, triton.next_power_of_2(dk))
    # 16 value channels a program: at Qwen3-Next's 128 x 128 heads, sm_90's ptxas keeps the
    # float32 dots of 32 x 128 tiles in registers with least spilling at 16 (vs 32) and 8 warps.
    bv = 16
    grid = (n, hv, triton.cdiv(dv, bv))
    _chunks_kernel[grid](
        q,
        k,
        v,
        g.float().contiguous(),
        beta.float().contiguous(),
        states,
        spans.to(torch.int32).contiguous(),
        out,
        q.stride(0),
        v.stride(0),
        states.stride(0),
        hv,
        hv // k.shape[1],
        dk,
        dv,
        dk**-0.5,
        C=chunk,
        BK=bk,
        BV=bv,
        PER_CHANNEL=g.dim() == 3,
        num_warps=8 if bk >= 128 else 4,
    )
