"""DeepSeek-V4's compressor update of a ubatch (model/families/deepseek_v4/batched.py's
`_compress`): for a decode ubatch (every row its sequence's only row) one launch: the window's
slots read from the pages, the softmax-gated pooling, the entry's norm and rotary, and every page
write; for prefill chunks beside decodes the same pooling with each slot at or past the chunk's
start read from the chunk's own rows (and CSA's first series of a window the chunk began inside
from its slots alike), then the state writes in launches of their own (`compress`'s
`chunk`).

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
def _window_slots(KV, GATE, OPEN_KV, OPEN_GATE, BIAS, src, wr, own, j, cols, live, width, row):
    """A window's slots [M_PAD, BLOCK] at `cols`: where `own`, the projections of the ubatch's
    rows `src` (`row` apart), else the open rings' rows `wr`; kv in the pages' dtype, gate
    biased float32."""
    mask = live[:, None] & (cols[None, :] < width)
    from_row = own[:, None] & mask
    from_page = ~own[:, None] & mask
    kv = tl.where(
        own[:, None],
        tl.load(KV + src[:, None] * row + cols[None, :], mask=from_row, other=0.0),
        tl.load(OPEN_KV + wr[:, None] * width + cols[None, :], mask=from_page, other=0.0),
    )
    gate = tl.where(
        own[:, None],
        tl.load(GATE + src[:, None] * row + cols[None, :], mask=from_row, other=0.0),
        tl.load(OPEN_GATE + wr[:, None] * width + cols[None, :], mask=from_page, other=0.0),
    ).to(tl.float32)
    gate += tl.load(BIAS + j[:, None] * width + cols[None, :], mask=mask, other=0.0)
    return kv, gate


@triton.jit
def _keep_first_series(
    KV,
    GATE,
    OPEN_KV,
    OPEN_GATE,
    BIAS,
    PREV_KV,
    PREV_GATE,
    src,
    wr,
    pw,
    own,
    j,
    live,
    keep_row,
    row,
    DIM: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """CSA: the window's first series (its slots' first DIM columns, gates biased) to the prev
    rows `pw` where `keep_row`: what the next window's entry overlaps."""
    for c in range(0, DIM, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        kv, gate = _window_slots(
            KV, GATE, OPEN_KV, OPEN_GATE, BIAS, src, wr, own, j, cols, live, WIDTH, row
        )
        keep = keep_row & live[:, None] & (cols[None, :] < DIM)
        tl.store(PREV_KV + pw[:, None] * DIM + cols[None, :], kv, mask=keep)
        tl.store(PREV_GATE + pw[:, None] * DIM + cols[None, :], gate, mask=keep)


@triton.jit
def _keep_open(KV, GATE, OPEN_KV, OPEN_GATE, r, row, opened, keep, WIDTH: tl.constexpr, BLOCK):
    """Row r's projections (`row` apart) to the open ring's row `opened` where `keep`."""
    for c in range(0, WIDTH, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        mask = (cols < WIDTH) & keep
        kv = tl.load(KV + r * row + cols, mask=mask, other=0.0)
        gate = tl.load(GATE + r * row + cols, mask=mask, other=0.0)
        tl.store(OPEN_KV + opened * WIDTH + cols, kv, mask=mask)
        tl.store(OPEN_GATE + opened * WIDTH + cols, gate, mask=mask)


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
    START,  # [rows] int64: the chunk's first position (CHUNKED)
    rows,
    row,  # the stride of KV's and GATE's rows (views of one packed GEMM's output)
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
    ADDRESS_WIDTH: tl.constexpr,  # m + 1, CSA 3 m + 1 (CHUNKED: 4 m + 1)
    BLOCK: tl.constexpr,
    FP8: tl.constexpr,  # the entries are an FP8 cache's pair (v4_pages.py)
    CHUNKED: tl.constexpr,  # rows of prefill chunks: pool and entries only (`compress_chunk`)
):
    r = tl.program_id(0)
    p = tl.load(POSITIONS + r)
    real = tl.load(REAL + r).to(tl.int1)
    w = p // M
    closes = real & ((p + 1) % M == 0)
    j = tl.arange(0, M_PAD)
    live = j < M
    if CHUNKED:
        start = tl.load(START + r)
        src = tl.minimum(tl.maximum(r - (p - (w * M + j)), 0), rows - 1)
    else:  # the row alone in its chunk: every earlier slot is in the ring
        start = p
        src = r + 0 * j
    own = w * M + j >= start
    at = ADDRESSES + r * ADDRESS_WIDTH
    wr = tl.load(at + j, mask=live, other=0)
    pr = wr
    pw = wr
    if OVERLAP:
        pr = tl.load(at + M + 1 + j, mask=live & (w > 0), other=0)
        pw = tl.load(at + 2 * M + 1 + j, mask=live, other=0)
    # CSA: window w - 1's first series from the prev rows where it closed before the chunk
    # (always so for a decode row), else from its slots as the window's own (CHUNKED).
    paged = w * M <= start
    earlier = (w - 1) * M + j
    er = wr
    if CHUNKED and OVERLAP:
        er = tl.load(at + 3 * M + 1 + j, mask=live & (w > 0) & ~paged, other=0)
    square_sum = 0.0
    for c in range(0, DIM, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        kv, gate = _window_slots(
            KV, GATE, OPEN_KV, OPEN_GATE, BIAS, src, wr, own, j, cols + SECOND, live, WIDTH, row
        )
        gate = tl.where(live[:, None], gate, float("-inf"))
        top = tl.max(gate, axis=0)
        if OVERLAP:
            first = live[:, None] & (cols[None, :] < DIM) & (w > 0)
            from_prev = first & paged
            first_kv = tl.load(
                PREV_KV + pr[:, None] * DIM + cols[None, :], mask=from_prev, other=0.0
            )
            first_gate = tl.load(
                PREV_GATE + pr[:, None] * DIM + cols[None, :], mask=from_prev, other=float("-inf")
            ).to(tl.float32)
            if CHUNKED:
                src_earlier = tl.minimum(tl.maximum(r - (p - earlier), 0), rows - 1)
                pending_kv, pending_gate = _window_slots(
                    KV,
                    GATE,
                    OPEN_KV,
                    OPEN_GATE,
                    BIAS,
                    src_earlier,
                    er,
                    earlier >= start,
                    j,
                    cols,
                    live & (w > 0) & ~paged,
                    WIDTH,
                    row,
                )
                first_kv = tl.where(paged, first_kv, pending_kv.to(first_kv.dtype))
                first_gate = tl.where(paged | ~first, first_gate, pending_gate)
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
    if OVERLAP and not CHUNKED:  # the window's first series, for the next window's entry
        _keep_first_series(
            KV,
            GATE,
            OPEN_KV,
            OPEN_GATE,
            BIAS,
            PREV_KV,
            PREV_GATE,
            src,
            wr,
            pw,
            own,
            j,
            live,
            closes,
            row,
            DIM,
            WIDTH,
            BLOCK,
        )
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
    if not CHUNKED:
        _keep_open(
            KV, GATE, OPEN_KV, OPEN_GATE, r, row, tl.load(at + M), real & ~closes, WIDTH, BLOCK
        )


@triton.jit
def _chunk_writes_kernel(
    KV,  # [rows, WIDTH]
    GATE,  # [rows, WIDTH]
    OPEN_KV,  # [flat rows, WIDTH]
    OPEN_GATE,  # [flat rows, WIDTH]
    ADDRESSES,  # [rows, ADDRESS_WIDTH] int64: `_compress_kernel`'s
    PREV_KV,  # [flat rows, DIM] (OVERLAP)
    PREV_GATE,  # [flat rows, DIM] float32 (OVERLAP)
    BIAS,  # [M, WIDTH] float32
    POSITIONS,  # [rows] int64
    START,  # [rows] int64
    KEEP,  # [rows] bool: FIRST the closing rows keeping their first series, else the open rows
    rows,
    row,
    M: tl.constexpr,
    M_PAD: tl.constexpr,
    DIM: tl.constexpr,
    WIDTH: tl.constexpr,
    ADDRESS_WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
    FIRST: tl.constexpr,
):
    """A chunk's state writes after its pooling: FIRST (CSA) the first series of the windows it
    closes where kept; then, in a launch of its own, the open rows it keeps. Separate launches
    because a chunk's rows read its sequence's rings (positions before the chunk) while others
    write them (positions near its end), which may share a ring row modulo R."""
    r = tl.program_id(0)
    keep = tl.load(KEEP + r).to(tl.int1)
    at = ADDRESSES + r * ADDRESS_WIDTH
    if FIRST:
        p = tl.load(POSITIONS + r)
        w = p // M
        j = tl.arange(0, M_PAD)
        live = j < M
        src = tl.minimum(tl.maximum(r - (p - (w * M + j)), 0), rows - 1)
        own = w * M + j >= tl.load(START + r)
        wr = tl.load(at + j, mask=live & keep, other=0)
        pw = tl.load(at + 2 * M + 1 + j, mask=live & keep, other=0)
        _keep_first_series(
            KV,
            GATE,
            OPEN_KV,
            OPEN_GATE,
            BIAS,
            PREV_KV,
            PREV_GATE,
            src,
            wr,
            pw,
            own,
            j,
            live,
            keep,
            row,
            DIM,
            WIDTH,
            BLOCK,
        )
    else:
        _keep_open(KV, GATE, OPEN_KV, OPEN_GATE, r, row, tl.load(at + M), keep, WIDTH, BLOCK)


def supports(kv: torch.Tensor, open_kv: torch.Tensor, dim: int, rope: int) -> bool:
    """Projections and pages of one float dtype, the projections' rows dense (rows may lie
    apart: kv and gate as slices of one GEMM's output), the pages contiguous; an even dim,
    rotary within it."""
    return (
        kv.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and kv.dtype == open_kv.dtype
        and kv.stride(1) == 1
        and open_kv.is_contiguous()
        and dim % 2 == 0
        and rope % 2 == 0
        and rope <= dim
    )


def compress(
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
    chunk: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """kv, gate [rows, width] (rows may lie apart, alike in both) -> the pooled entries
    [rows, dim] (kept where a row closes its window; as the entries page gives them back), the
    pages written. pages: the flat `open_kv`, `open_gate` (rings), `entries` (an FP8 cache's:
    e4m3 at `kv_scale` beside `entries_rope`, v4_pages.store_row), and CSA's `prev_kv`,
    `prev_gate`; addresses [rows, m + 1 (CSA: + 2 m)]: the open rings' rows of the window's
    positions and of p (and the prev pages' rows of windows w - 1 and w, in the row's block
    table); entry_rows [rows]: the entries page's row of the entry p closes; norm: (weight,
    eps); rope: (inv_freq, scaling).
    `chunk` (rows of prefill chunks beside decodes, not each alone in its chunk): (the chunks'
    first positions, the closing rows that keep their window's first series, the rows that keep
    their projections in the open ring) [rows]; CSA's addresses then also hold the open rings'
    rows of window w - 1's positions [rows, m] (a window the chunk began inside). Three launches:
    the pooling and entries, then the first series, then the open rows (`_chunk_writes_kernel`
    says why). A row's window slots at or past its chunk's start come from the chunk's rows;
    only a row that closes its window has its pooled entry right (the others' are read by no
    one: `_compress`'s contract)."""
    if gate.stride() != kv.stride():  # the kernels read both at one row stride
        kv, gate = kv.contiguous(), gate.contiguous()
    count = kv.shape[0]
    new = torch.empty(count, dim, dtype=kv.dtype, device=kv.device)
    if count == 0:
        return new
    overlap = "prev_kv" in pages
    prev = (pages["prev_kv"], pages["prev_gate"]) if overlap else (kv, kv)  # kv: never read
    inv_freq, scaling = rope
    fp8 = "entries_rope" in pages
    addresses = addresses.contiguous()
    shape = dict(
        M=rate,
        M_PAD=triton.next_power_of_2(rate),
        DIM=dim,
        WIDTH=kv.shape[1],
        ADDRESS_WIDTH=addresses.shape[1],
        BLOCK=min(BLOCK_COLUMNS, triton.next_power_of_2(dim)),
        # HCA's 128 slots make [128, 64] tiles of kv, gate and weights (chosen, not measured).
        num_warps=8 if rate >= 32 else 4,
    )
    start = positions if chunk is None else chunk[0]
    _compress_kernel[(count,)](
        kv,
        gate,
        pages["open_kv"],
        pages["open_gate"],
        addresses,
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
        start,
        count,
        kv.stride(0),
        norm[1],
        scaling,
        pages["entries"].shape[1] if fp8 else dim,
        kv_scale,
        SECOND=dim if overlap else 0,
        ROPE=2 * inv_freq.shape[0],
        OVERLAP=overlap,
        FP8=fp8,
        CHUNKED=chunk is not None,
        **shape,
    )
    if chunk is not None:
        writes = (kv, gate, pages["open_kv"], pages["open_gate"], addresses, *prev, position_bias)
        for first, keep in ((True, chunk[1]), (False, chunk[2])):
            if first and not overlap:
                continue
            _chunk_writes_kernel[(count,)](
                *writes,
                positions,
                start,
                keep.contiguous(),
                count,
                kv.stride(0),
                FIRST=first,
                **shape,
            )
    return new
