"""DeepSeek-V4's compressor update of a decode ubatch (model/families/deepseek_v4/batched.py's
`_compress` where every row is its sequence's only row) in one launch: the window's slots read
from the pages, the softmax-gated pooling, the entry's norm and rotary, and every page write.

One program per row at position p, window w = p // m. Slot j of the window is position w m + j:
p's own projections `KV`, `GATE` for j = p - w m, the open rows `ADDRESSES[r, j]` (the ring in
the row's sequence slot, position q at its row q % R: LayerPages computes every address) before
it (later slots are read from the row itself and never kept: only a row that closes its window,
p = (w + 1) m - 1, has no later slot, and only its entry is stored or read). CSA (`OVERLAP`): m
more slots before them, window w - 1's first series from the prev pages at `ADDRESSES[r, m + 1 +
j]` (weight 0 before window 0), the window's own slots taking the second series. The gates get
the position bias in float32; the pooled row is rounded to the projections' dtype, normalised
with the compressor's norm and rotated on its trailing pairs at position w m (cos and sin
rounded to that dtype, as `rope_tail`). Writes, as `_compress`: a closing row its entry at
`ENTRY_ROW[r]` and (CSA) the window's first series to the prev pages at `ADDRESSES[r, 2 m + 1 +
j]`, after every read of them (a barrier: the prev rows alias window w - 1's); any other real
row its projections to the open ring at `ADDRESSES[r, m]`. Pad rows write nothing. Loop bounds
are constexpr (for Triton 3.6's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afdserve.kernels.triton.v4_pages import store_row

BLOCK_COLUMNS = 64  # columns a step of the loops takes (not measured)


@triton.jit
def _window_slots(KV, GATE, OPEN_KV, OPEN_GATE, BIAS, r, wr, own, j, cols, live, width):
    """The window's slots [M_PAD, BLOCK] at `cols`: kv in the pages' dtype, gate biased float32."""
    mask = live[:, None] & (cols[None, :] < width)
    from_row = own[:, None] & mask
    from_page = ~own[:, None] & mask
    kv = tl.where(
        own[:, None],
        tl.load(KV + r * width + cols[None, :] + 0 * j[:, None], mask=from_row, other=0.0),
        tl.load(OPEN_KV + wr[:, None] * width + cols[None, :], mask=from_page, other=0.0),
    )
    gate = tl.where(
        own[:, None],
        tl.load(GATE + r * width + cols[None, :] + 0 * j[:, None], mask=from_row, other=0.0),
        tl.load(OPEN_GATE + wr[:, None] * width + cols[None, :], mask=from_page, other=0.0),
    ).to(tl.float32)
    gate += tl.load(BIAS + j[:, None] * width + cols[None, :], mask=mask, other=0.0)
    return kv, gate


@triton.jit
def _compress_kernel(
    KV,  # [rows, width]: the rows' kv projections
    GATE,  # [rows, width]
    OPEN_KV,  # [flat rows, width]: the open rings of every sequence slot
    OPEN_GATE,  # [flat rows, width]
    ADDRESSES,  # [rows, M + 1 (+ 2 M)] int64: open rows of the window and p, (prev of w - 1, w)
    PREV_KV,  # [flat rows, DIM] (OVERLAP)
    PREV_GATE,  # [flat rows, DIM] float32 (OVERLAP)
    BIAS,  # [M, width] float32
    NORM_WEIGHT,  # [DIM] float32
    INV_FREQ,  # [ROPE / 2] float32
    ENTRIES,  # [flat rows, DIM]: the entries page (FP8: its e4m3 channels [flat rows, nope])
    ENTRY_ROPE,  # [flat rows, DIM - nope] bf16: an FP8 cache's rotated channels (FP8)
    ENTRY_ROW,  # [rows] int64: the entries page's row of the entry p closes
    NEW,  # [rows, DIM]: the pooled entry (kept where p closes its window)
    POSITIONS,  # [rows] int64
    REAL,  # [rows] bool
    norm_eps,
    scaling,
    nope,  # the entries' unrotated channels (FP8)
    kv_scale,  # an FP8 cache's scale (FP8)
    M: tl.constexpr,
    M_PAD: tl.constexpr,
    DIM: tl.constexpr,
    WIDTH: tl.constexpr,  # 2 DIM (OVERLAP) or DIM
    SECOND: tl.constexpr,  # the first column of the window's own slots: DIM (OVERLAP) or 0
    ROPE: tl.constexpr,
    OVERLAP: tl.constexpr,
    ADDRESS_WIDTH: tl.constexpr,  # m + 1, CSA 3 m + 1
    BLOCK: tl.constexpr,
    FP8: tl.constexpr,  # the entries are an FP8 cache's pair (v4_pages.py)
):
    r = tl.program_id(0)
    p = tl.load(POSITIONS + r)
    real = tl.load(REAL + r).to(tl.int1)
    w = p // M
    closes = real & ((p + 1) % M == 0)
    j = tl.arange(0, M_PAD)
    live = j < M
    own = w * M + j >= p
    at = ADDRESSES + r * ADDRESS_WIDTH
    wr = tl.load(at + j, mask=live, other=0)
    pr = wr
    pw = wr
    if OVERLAP:
        pr = tl.load(at + M + 1 + j, mask=live & (w > 0), other=0)
        pw = tl.load(at + 2 * M + 1 + j, mask=live, other=0)
    square_sum = 0.0
    for c in range(0, DIM, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        kv, gate = _window_slots(
            KV, GATE, OPEN_KV, OPEN_GATE, BIAS, r, wr, own, j, cols + SECOND, live, WIDTH
        )
        gate = tl.where(live[:, None], gate, float("-inf"))
        top = tl.max(gate, axis=0)
        if OVERLAP:
            first = live[:, None] & (cols[None, :] < DIM) & (w > 0)
            first_kv = tl.load(PREV_KV + pr[:, None] * DIM + cols[None, :], mask=first, other=0.0)
            first_gate = tl.load(
                PREV_GATE + pr[:, None] * DIM + cols[None, :], mask=first, other=float("-inf")
            ).to(tl.float32)
            top = tl.maximum(top, tl.max(first_gate, axis=0))
        weights = tl.exp(gate - top[None, :])
        total = tl.sum(weights, axis=0)
        if OVERLAP:
            first_weights = tl.exp(first_gate - top[None, :])
            total += tl.sum(first_weights, axis=0)
        dtype = KV.dtype.element_ty
        # (kv * weights) in the projections' dtype, the sum over slots in float32, rounded once.
        weights = (weights / total[None, :]).to(dtype).to(tl.float32)
        pooled = tl.sum((kv.to(tl.float32) * weights).to(dtype).to(tl.float32), axis=0)
        if OVERLAP:
            first_weights = (first_weights / total[None, :]).to(dtype).to(tl.float32)
            products = (first_kv.to(tl.float32) * first_weights).to(dtype).to(tl.float32)
            pooled += tl.sum(products, axis=0)
        pooled = pooled.to(dtype)
        squares = tl.where(cols < DIM, pooled.to(tl.float32), 0.0)
        square_sum += tl.sum(squares * squares, axis=0)
        tl.store(NEW + r * DIM + cols, pooled, mask=cols < DIM)
    tl.debug_barrier()  # every read of the prev pages and of NEW's columns is done
    if OVERLAP:  # the window's first series, for the next window's entry
        for c in range(0, DIM, BLOCK):
            cols = c + tl.arange(0, BLOCK)
            kv, gate = _window_slots(
                KV, GATE, OPEN_KV, OPEN_GATE, BIAS, r, wr, own, j, cols, live, WIDTH
            )
            keep = closes & live[:, None] & (cols[None, :] < DIM)
            tl.store(PREV_KV + pw[:, None] * DIM + cols[None, :], kv, mask=keep)
            tl.store(PREV_GATE + pw[:, None] * DIM + cols[None, :], gate, mask=keep)
    inv = 1.0 / tl.sqrt(square_sum / DIM + norm_eps)
    start = (w * M).to(tl.float32)
    entry = tl.load(ENTRY_ROW + r)
    for c in range(0, DIM, BLOCK):
        even = c + 2 * tl.arange(0, BLOCK // 2)
        inside = even < DIM
        dtype = NEW.dtype.element_ty
        x_even = tl.load(NEW + r * DIM + even, mask=inside, other=0.0).to(tl.float32)
        x_odd = tl.load(NEW + r * DIM + even + 1, mask=inside, other=0.0).to(tl.float32)
        w_even = tl.load(NORM_WEIGHT + even, mask=inside, other=0.0).to(tl.float32)
        w_odd = tl.load(NORM_WEIGHT + even + 1, mask=inside, other=0.0).to(tl.float32)
        x_even = (w_even * (x_even * inv)).to(dtype).to(tl.float32)
        x_odd = (w_odd * (x_odd * inv)).to(dtype).to(tl.float32)
        pair = (even - (DIM - ROPE)) // 2
        rotated = inside & (even >= DIM - ROPE)
        angle = start * tl.load(INV_FREQ + pair, mask=rotated, other=0.0)
        cos = (tl.cos(angle) * scaling).to(dtype).to(tl.float32)
        sin = (tl.sin(angle) * scaling).to(dtype).to(tl.float32)
        out_even = tl.where(rotated, x_even * cos - x_odd * sin, x_even).to(dtype)
        out_odd = tl.where(rotated, x_odd * cos + x_even * sin, x_odd).to(dtype)
        # The entry as the page keeps it, and NEW as the page gives it back (as_stored).
        kept = inside & closes
        out_even = store_row(
            ENTRIES, ENTRY_ROPE, entry, out_even, even, kept, DIM, nope, kv_scale, FP8
        )
        out_odd = store_row(
            ENTRIES, ENTRY_ROPE, entry, out_odd, even + 1, kept, DIM, nope, kv_scale, FP8
        )
        tl.store(NEW + r * DIM + even, out_even, mask=inside)
        tl.store(NEW + r * DIM + even + 1, out_odd, mask=inside)
    opened = tl.load(at + M)
    for c in range(0, WIDTH, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        keep = (cols < WIDTH) & real & ~closes
        kv = tl.load(KV + r * WIDTH + cols, mask=keep, other=0.0)
        gate = tl.load(GATE + r * WIDTH + cols, mask=keep, other=0.0)
        tl.store(OPEN_KV + opened * WIDTH + cols, kv, mask=keep)
        tl.store(OPEN_GATE + opened * WIDTH + cols, gate, mask=keep)


def supports(kv: torch.Tensor, open_kv: torch.Tensor, dim: int, rope: int) -> bool:
    """Projections and pages of one float dtype, contiguous; an even dim, rotary within it."""
    return (
        kv.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and kv.dtype == open_kv.dtype
        and kv.is_contiguous()
        and open_kv.is_contiguous()
        and dim % 2 == 0
        and rope % 2 == 0
        and rope <= dim
    )


def compress_decode(
    kv: torch.Tensor,
    gate: torch.Tensor,
    pages: dict[str, torch.Tensor],
    addresses: torch.Tensor,
    entry_rows: torch.Tensor,
    position_bias: torch.Tensor,
    norm: tuple[torch.Tensor, float],
    rope: tuple[torch.Tensor, float],
    positions: torch.Tensor,
    real: torch.Tensor,
    rate: int,
    dim: int,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """kv, gate [rows, width] -> the pooled entries [rows, dim] (kept where a row closes its
    window; as the entries page gives them back), the pages written. pages: the flat `open_kv`,
    `open_gate` (rings), `entries` (an FP8 cache's: e4m3 at `kv_scale` beside `entries_rope`,
    v4_pages.store_row), and CSA's `prev_kv`, `prev_gate`; addresses [rows, m + 1 (CSA: + 2
    m)]: the open rings' rows of the window's positions and of p (and the prev pages' rows of
    windows w - 1 and w, in the row's block table); entry_rows [rows]: the entries page's row of
    the entry p closes; norm: (weight, eps); rope: (inv_freq, scaling)."""
    count = kv.shape[0]
    new = torch.empty(count, dim, dtype=kv.dtype, device=kv.device)
    if count == 0:
        return new
    overlap = "prev_kv" in pages
    prev = (pages["prev_kv"], pages["prev_gate"]) if overlap else (kv, kv)  # kv: never read
    inv_freq, scaling = rope
    fp8 = "entries_rope" in pages
    _compress_kernel[(count,)](
        kv,
        gate,
        pages["open_kv"],
        pages["open_gate"],
        addresses.contiguous(),
        *prev,
        position_bias,
        norm[0],
        inv_freq,
        pages["entries"],
        pages.get("entries_rope", pages["entries"]),
        entry_rows.contiguous(),
        new,
        positions,
        real,
        norm[1],
        scaling,
        pages["entries"].shape[1] if fp8 else dim,
        kv_scale,
        M=rate,
        M_PAD=triton.next_power_of_2(rate),
        DIM=dim,
        WIDTH=kv.shape[1],
        SECOND=dim if overlap else 0,
        ROPE=2 * inv_freq.shape[0],
        OVERLAP=overlap,
        ADDRESS_WIDTH=addresses.shape[1],
        BLOCK=min(BLOCK_COLUMNS, triton.next_power_of_2(dim)),
        FP8=fp8,
        # HCA's 128 slots make [128, 64] tiles of kv, gate and weights (chosen, not measured).
        num_warps=8 if rate >= 32 else 4,
    )
    return new
