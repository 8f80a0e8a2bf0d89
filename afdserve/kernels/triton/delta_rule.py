"""One decode step of the gated delta rule as one Triton launch (the torch reference is seven
passes over the state): each program holds one sequence's value head, a block of its value
channels, reads its slot's state once and writes it once. Same math as
kernels/reference/delta_rule.py, float32 throughout; graph capturable (no host sync)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _step_kernel(
    Q,  # [b, hk, dk]
    K,
    V,  # [b, hv, dv]
    G,  # [b, hv] or [b, hv, dk]
    BETA,  # [b, hv]
    S,  # [slots, hv, dk, dv] float32, slot stride stride_s
    SLOTS,  # [b]
    FRESH,  # [b] int8
    OUT,  # [b, hv, dv] float32
    stride_s,
    hv,
    group,  # value heads per key head
    dk,
    dv,
    scale,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
):
    seq, head, vblock = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kh = head // group
    rk = tl.arange(0, BK)
    rv = vblock * BV + tl.arange(0, BV)
    slot = tl.load(SLOTS + seq).to(tl.int64)
    live = slot >= 0  # slot -1: the pad marker, nothing read but its slot, output zero
    mk, mv = (rk < dk) & live, (rv < dv) & live
    q = tl.load(Q + (seq * (hv // group) + kh) * dk + rk, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(K + (seq * (hv // group) + kh) * dk + rk, mask=mk, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    v = tl.load(V + (seq * hv + head) * dv + rv, mask=mv, other=0.0).to(tl.float32)
    beta = tl.load(BETA + seq * hv + head).to(tl.float32)
    if PER_CHANNEL:
        g = tl.load(G + (seq * hv + head) * dk + rk, mask=mk, other=0.0).to(tl.float32)
        decay = tl.exp(g)[:, None]
    else:
        decay = tl.exp(tl.load(G + seq * hv + head).to(tl.float32))
    base = S + tl.maximum(slot, 0) * stride_s + head * dk * dv
    tile = rk[:, None] * dv + rv[None, :]
    mask = mk[:, None] & mv[None, :]
    s = tl.load(base + tile, mask=mask, other=0.0)
    keep = tl.load(FRESH + seq) == 0
    s = tl.where(keep, s, 0.0) * decay
    u = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * u[None, :]
    tl.store(base + tile, s, mask=mask)
    o = tl.where(live, tl.sum(s * q[:, None], axis=0), 0.0)
    tl.store(OUT + (seq * hv + head) * dv + rv, o, mask=rv < dv)


def step_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
) -> torch.Tensor:
    """As reference.delta_rule.step_slots (its docstring has the shapes); an entry of slot -1
    is skipped (the grid is sized by the entries' capacity: a graph's pad entries cost a
    program that reads its slot and stores zeros)."""
    b, hv, dv = v.shape
    dk = k.shape[-1]
    out = torch.empty(b, hv, dv, dtype=torch.float32, device=v.device)
    if b == 0:
        return out
    bk = triton.next_power_of_2(dk)
    bv = min(triton.next_power_of_2(dv), max(16, 8192 // bk))
    grid = (b, hv, triton.cdiv(dv, bv))
    _step_kernel[grid](
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g.float().contiguous(),
        beta.float().contiguous(),
        states,
        slots.contiguous(),
        fresh.to(torch.int8).contiguous(),
        out,
        states.stride(0),
        hv,
        hv // k.shape[1],
        dk,
        dv,
        dk**-0.5,
        BK=bk,
        BV=bv,
        PER_CHANNEL=g.dim() == 3,
    )
    return out
