"""DeepSeek-V4's manifold-constrained hyper-connections (mHC, model/families/deepseek_v4/mhc.py)
at one site in two launches instead of about sixty: the streams' update after a block, the site's
mappings with their Sinkhorn iterations, the collapse into one row and the norm after it.

`_mix_kernel`, one program per (block of rows, chunk of hidden): h' = post * y + comb^T h for its
columns (skipped at layer 0, where there is no block output yet), stored; then the chunk's share
of h''s sum of squares and of the (2 + n) n dot products of h' with the mapping weight `fn`. Each
program loads its slice of `fn` once for all its rows, so `fn` (n (2 + n) n hidden floats: 1.5 MB
on V4-Flash) is read from memory once however many rows there are.
`_mix_rows_kernel`, the same for prefill-sized row counts: one program per (block of rows, chunk
of hidden), which takes its chunk in steps of columns and each step one stream at a time: the
stream's update, [rows, step] (`_updated_stream`), and its product with that stream's columns of
`fn` as one more K range of a `tl.dot` (`ROWS_DOT`: three bf16 passes on tensor cores, near
float32). The two mixing kernels run chunks first in launch order (see the launch below).
`_expand_kernel`, the update alone, where no site follows (after the last layer).
`_collapse_kernel`, one program per row: the partial sums of all chunks loaded at once and reduced
in a fixed order (no atomics: the same bits every run), the mappings (sigmoids, softmax, Sinkhorn
in registers), the collapse sum_j pre_j h'_j rounded to the streams' dtype and the weighted RMS
norm of it.

Numerics follow the torch path: post and comb rounded to the streams' dtype before the update and
each product and sum rounded as torch's; the mappings in float32; the norm's statistics of the
rounded collapse. The torch path normalises h' before the dot products, this one scales the dots
(the same value up to float32 rounding). Loops have constexpr bounds (Triton 3.6's interpreter
runs no other).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements of `fn` one program holds in registers, and rows it takes (chosen so a program's tile
# stays near 32 float32 registers a thread at eight warps; not measured).
FN_TILE = 8192
MAX_ROWS_PER_PROGRAM = 8
# From this many rows a site takes `_mix_rows_kernel`, BLOCK_ROWS rows a program. The mix's time
# grows with its number of programs, not its rows: 64 rows a program took half the time of 32
# at 1024 and 8192 rows, and the same at 64 (tools/mhc_bench.py, docs/benchmarks.md 2026-12-06).
ROWS_KERNEL_FROM = 64
BLOCK_ROWS = 64
# How `_mix_rows_kernel` multiplies float32 `fn` by the block's rows: "bf16x3" on tensor cores
# (bf16 streams are exact bf16 operands; fn split into three bf16 parts, 24 bits in all), or a
# `tl.dot` input precision ("ieee": float32 FMAs; "tf32x3"), bf16x3 the fastest of the three
# (docs/benchmarks.md, 2026-12-06); other dtypes than bf16 take ieee.
ROWS_DOT = "bf16x3"
# `_mix_rows_kernel`'s columns of each stream a program, in steps of ROWS_STEP (a loop), and
# its warps. Its tiles are [rows, columns] of one stream at a time, so the streams are read in
# 128-bit vectors and 64 rows by 64 columns take 128 registers a thread: two programs an SM.
# Swept on one H100 at V4-Flash's site (tools/mhc_bench.py, docs/benchmarks.md 2026-12-07):
# 64 x 64 columns at 8 warps 0.570 ms at 8192 rows (steps of 32: 0.775; chunks of 256 or 512
# columns within 4%, slower at 64 rows), where the first form, gathered [rows, 4 x 64] tiles at
# 239 registers, took 1.95 ms.
ROWS_CHUNK = 64
ROWS_STEP = 64
ROWS_WARPS = 8
COLLAPSE_BLOCK = 1024  # columns per step of the collapse and norm loops (not measured)


@triton.jit
def _mix_kernel(
    H,  # [rows, n, hidden]: the streams before the update
    Y,  # [rows, hidden]: the block's output (EXPAND only)
    POST,  # [rows, n] float32: the previous site's post (EXPAND only)
    COMB,  # [rows, n, n] float32: the previous site's comb (EXPAND only)
    H_OUT,  # [rows, n, hidden]: the streams after it (EXPAND only)
    FN,  # [mixes, n * hidden]
    PARTIAL,  # [rows, CHUNKS, MIX_PAD] float32: dots, then the sum of squares at `mixes`
    rows,
    n,
    hidden,
    mixes,
    EXPAND: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNKS: tl.constexpr,
    BLOCK: tl.constexpr,
    N_PAD: tl.constexpr,
    MIX_PAD: tl.constexpr,
):
    first_row, chunk = tl.program_id(1) * ROWS, tl.program_id(0)
    stream = tl.arange(0, N_PAD)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mix = tl.arange(0, MIX_PAD)
    tile = (stream[:, None] < n) & (cols[None, :] < hidden)  # [N_PAD, BLOCK]
    fn = tl.load(
        FN + mix[:, None, None] * n * hidden + (stream[:, None] * hidden + cols[None, :])[None],
        mask=(mix[:, None, None] < mixes) & tile[None],
        other=0.0,
    ).to(tl.float32)  # [MIX_PAD, N_PAD, BLOCK]
    offsets = stream[:, None] * hidden + cols[None, :]
    for i in range(ROWS):
        row = first_row + i
        here = tile & (row < rows)
        h = tl.load(H + row * n * hidden + offsets, mask=here, other=0.0)
        if EXPAND:
            dtype = H.dtype.element_ty
            pair = (stream[:, None] < n) & (stream[None, :] < n) & (row < rows)
            # comb^T h: out[k] = sum_j comb[j, k] h[j], comb rounded to the streams' dtype first.
            comb = tl.load(
                COMB + row * n * n + stream[:, None] * n + stream[None, :], mask=pair, other=0.0
            )
            comb = comb.to(dtype).to(tl.float32)
            mixed = tl.sum(comb[:, :, None] * h.to(tl.float32)[:, None, :], axis=0).to(dtype)
            post = tl.load(POST + row * n + stream, mask=(stream < n) & (row < rows), other=0.0)
            y = tl.load(Y + row * hidden + cols, mask=(cols < hidden) & (row < rows), other=0.0)
            spread = (post.to(dtype).to(tl.float32)[:, None] * y.to(tl.float32)[None, :]).to(dtype)
            h = (spread.to(tl.float32) + mixed.to(tl.float32)).to(dtype)
            tl.store(H_OUT + row * n * hidden + offsets, h, mask=here)
        h = h.to(tl.float32)
        dots = tl.sum(tl.sum(fn * h[None], axis=2), axis=1)  # [MIX_PAD]
        squares = tl.sum(tl.sum(h * h, axis=1), axis=0)
        sums = tl.where(mix == mixes, squares, dots)
        tl.store(PARTIAL + (row * CHUNKS + chunk) * MIX_PAD + mix, sums, mask=row < rows)


@triton.jit
def _updated_stream(
    streams,  # the streams' first element of the tile's rows and columns, stream 0
    h_at,  # [ROWS, STEP] int32: offsets of stream 0's tile
    live,  # [ROWS, STEP]
    COMB,
    POST,
    at_row,  # [ROWS]: the tile's rows
    live_row,
    y,  # [ROWS, STEP] float32: the block output's columns
    n,
    hidden,
    k,
    ROWS: tl.constexpr,
    STEP: tl.constexpr,
    N_PAD: tl.constexpr,
):
    """Stream k of the update, one [rows, columns] tile: post_k y + sum_j comb[j, k] h_j (comb^T
    h), post and comb rounded to the streams' dtype first; the other streams' tiles read from
    cache after the first stream's."""
    dtype = streams.dtype.element_ty
    mixed = tl.zeros([ROWS, STEP], dtype=tl.float32)
    for j in range(N_PAD):  # a constexpr bound (module docstring); streams past n masked
        h_j = tl.load(streams + j * hidden + h_at, mask=live & (j < n), other=0.0)
        comb = tl.load(
            COMB + at_row * n * n + j * n + k, mask=live_row & (j < n) & (k < n), other=0.0
        )
        mixed += comb.to(dtype).to(tl.float32)[:, None] * h_j.to(tl.float32)
    post = tl.load(POST + at_row * n + k, mask=live_row & (k < n), other=0.0)
    spread = (post.to(dtype).to(tl.float32)[:, None] * y).to(dtype)
    return (spread.to(tl.float32) + mixed.to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _mix_rows_kernel(
    H,  # [rows, n, hidden]: the streams before the update
    Y,  # [rows, hidden]: the block's output (EXPAND only)
    POST,  # [rows, n] float32: the previous site's post (EXPAND only)
    COMB,  # [rows, n, n] float32: the previous site's comb (EXPAND only)
    H_OUT,  # [rows, n, hidden]: the streams after it (EXPAND only)
    FN,  # [mixes, n * hidden]
    PARTIAL,  # [rows, CHUNKS, MIX_PAD] float32: dots, then the sum of squares at `mixes`
    rows,
    n,
    hidden,
    mixes,
    EXPAND: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNKS: tl.constexpr,
    BLOCK: tl.constexpr,
    N_PAD: tl.constexpr,
    MIX_PAD: tl.constexpr,
    DOT: tl.constexpr,  # ROWS_DOT, resolved for the streams' dtype
    STEP: tl.constexpr,  # columns of each stream a step of the chunk's loop (divides BLOCK)
):
    # 64-bit: a long prefill's streams pass 2^31 elements (131072 rows of 4 x 4096).
    first_row, chunk = tl.program_id(1).to(tl.int64) * ROWS, tl.program_id(0)
    r = tl.arange(0, ROWS)  # rows within the block
    c = tl.arange(0, STEP)
    mix = tl.arange(0, MIX_PAD)
    live_row = first_row + r < rows
    # Offsets within the block and step, int32 and held across the loops; each step moves the
    # scalar bases (64-bit pointer tensors held across it took ~180 registers a thread).
    h_at = r[:, None] * n * hidden + c[None, :]  # [ROWS, STEP]: stream 0's
    y_at = r[:, None] * hidden + c[None, :]
    fn_at = mix[None, :] * n * hidden + c[:, None]  # [STEP, MIX_PAD]: stream 0's
    dots = tl.zeros([ROWS, MIX_PAD], dtype=tl.float32)
    squares = tl.zeros([ROWS], dtype=tl.float32)
    for step in range(BLOCK // STEP):  # constexpr bounds (module docstring)
        first_col = chunk * BLOCK + step * STEP
        live = live_row[:, None] & (first_col + c < hidden)[None, :]  # [ROWS, STEP]
        streams = H + first_row * n * hidden + first_col
        if EXPAND:
            y = tl.load(Y + first_row * hidden + first_col + y_at, mask=live, other=0.0)
            y = y.to(tl.float32)
        # One output stream at a time, all in [rows, columns] tiles of one shape: its update
        # reads the step's columns of every stream (from cache after the first), its product
        # with the stream's columns of `fn` is one more K range of the dots.
        for k in range(N_PAD):  # streams past n masked
            live_k = live & (k < n)
            if EXPAND:
                h = _updated_stream(
                    streams, h_at, live, COMB, POST, first_row + r, live_row, y,
                    n, hidden, k, ROWS, STEP, N_PAD,
                )  # fmt: skip
                at = first_row * n * hidden + first_col + k * hidden + h_at
                tl.store(H_OUT + at, h, mask=live_k)
            else:
                h = tl.load(streams + k * hidden + h_at, mask=live_k, other=0.0)
            h = tl.where(live_k, h.to(tl.float32), 0.0)
            fn = tl.load(
                FN + first_col + k * hidden + fn_at,
                mask=((first_col + c < hidden) & (k < n))[:, None] & (mix[None, :] < mixes),
                other=0.0,
            ).to(tl.float32)  # [STEP, MIX_PAD]
            if DOT == "bf16x3":  # h holds bf16 values: exact as a bf16 operand
                hb = h.to(tl.bfloat16)
                hi = fn.to(tl.bfloat16)
                rest = fn - hi.to(tl.float32)
                mid = rest.to(tl.bfloat16)
                lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
                dots = tl.dot(hb, lo, dots)
                dots = tl.dot(hb, mid, dots)
                dots = tl.dot(hb, hi, dots)  # [ROWS, MIX_PAD]
            else:
                dots = tl.dot(h, fn, dots, input_precision=DOT)
            squares += tl.sum(h * h, axis=1)
    sums = tl.where(mix[None, :] == mixes, squares[:, None], dots)
    tl.store(
        PARTIAL + ((first_row + r[:, None]) * CHUNKS + chunk) * MIX_PAD + mix[None, :],
        sums,
        mask=live_row[:, None],
    )


@triton.jit
def _expand_kernel(
    H,  # [rows, n, hidden]: the streams before the update
    Y,  # [rows, hidden]: the block's output
    POST,  # [rows, n] float32
    COMB,  # [rows, n, n] float32
    H_OUT,  # [rows, n, hidden]: the streams after it
    rows,
    n,
    hidden,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    STEP: tl.constexpr,
    N_PAD: tl.constexpr,
):
    """The update alone (after the last layer, where no site follows), `_mix_rows_kernel`'s
    tiles without the products."""
    # 64-bit: a long prefill's streams pass 2^31 elements (131072 rows of 4 x 4096).
    first_row, chunk = tl.program_id(1).to(tl.int64) * ROWS, tl.program_id(0)
    r = tl.arange(0, ROWS)
    c = tl.arange(0, STEP)
    live_row = first_row + r < rows
    h_at = r[:, None] * n * hidden + c[None, :]
    y_at = r[:, None] * hidden + c[None, :]
    for step in range(BLOCK // STEP):  # constexpr bounds (module docstring)
        first_col = chunk * BLOCK + step * STEP
        live = live_row[:, None] & (first_col + c < hidden)[None, :]
        streams = H + first_row * n * hidden + first_col
        y = tl.load(Y + first_row * hidden + first_col + y_at, mask=live, other=0.0)
        y = y.to(tl.float32)
        for k in range(N_PAD):
            h = _updated_stream(
                streams, h_at, live, COMB, POST, first_row + r, live_row, y,
                n, hidden, k, ROWS, STEP, N_PAD,
            )  # fmt: skip
            at = first_row * n * hidden + first_col + k * hidden + h_at
            tl.store(H_OUT + at, h, mask=live & (k < n))


@triton.jit
def _collapse_kernel(
    H,  # [rows, n, hidden]: the streams (after the update)
    PARTIAL,  # [rows, PARTS, MIX_PAD] float32
    BASE,  # [mixes] float32
    SCALE,  # [3] float32: pre's, post's, comb's
    WEIGHT,  # [hidden]: the norm's weight
    X,  # [rows, hidden]: the normalised collapse
    POST_OUT,  # [rows, n] float32
    COMB_OUT,  # [rows, n, n] float32
    n,
    hidden,
    mixes,
    hc_eps,
    hc_norm_eps,
    norm_eps,
    ITERS: tl.constexpr,
    PARTS: tl.constexpr,
    PARTS_PAD: tl.constexpr,
    CHUNKS: tl.constexpr,
    BLOCK: tl.constexpr,
    N_PAD: tl.constexpr,
    MIX_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # 64-bit, as the mixing kernels' rows
    j = tl.arange(0, N_PAD)
    live = j < n
    pair = live[:, None] & live[None, :]
    pair_at = 2 * n + j[:, None] * n + j[None, :]
    # Every chunk's partials in one load each, summed across chunks: a loop over the chunks
    # (64 at V4-Flash's site) waits on each chunk's loads in turn, one program a row.
    part = tl.arange(0, PARTS_PAD)
    part_live = part < PARTS
    at = PARTIAL + row * PARTS * MIX_PAD + part * MIX_PAD  # [PARTS_PAD]
    squares = tl.sum(tl.load(at + mixes, mask=part_live, other=0.0), axis=0)
    by_part = part_live[:, None] & live[None, :]
    pre = tl.sum(tl.load(at[:, None] + j[None, :], mask=by_part, other=0.0), axis=0)
    post = tl.sum(tl.load(at[:, None] + n + j[None, :], mask=by_part, other=0.0), axis=0)
    comb = tl.sum(
        tl.load(
            at[:, None, None] + pair_at[None, :, :],
            mask=part_live[:, None, None] & pair[None, :, :],
            other=0.0,
        ),
        axis=0,
    )
    inv = 1.0 / tl.sqrt(squares / (n * hidden) + hc_norm_eps)
    pre = tl.sigmoid(pre * inv * tl.load(SCALE) + tl.load(BASE + j, mask=live, other=0.0)) + hc_eps
    post = 2.0 * tl.sigmoid(
        post * inv * tl.load(SCALE + 1) + tl.load(BASE + n + j, mask=live, other=0.0)
    )
    logits = comb * inv * tl.load(SCALE + 2) + tl.load(BASE + pair_at, mask=pair, other=0.0)
    # Padded columns take no mass; padded rows (all masked later) stay finite.
    logits = tl.where(pair, logits, tl.where(live[:, None], float("-inf"), 0.0))
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = tl.where(pair, e / tl.sum(e, axis=1)[:, None] + hc_eps, 0.0)
    # Sinkhorn-Knopp as the torch path: columns, then (ITERS - 1) rounds of rows and columns.
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    tl.store(POST_OUT + row * n + j, post, mask=live)
    tl.store(COMB_OUT + row * n * n + j[:, None] * n + j[None, :], comb, mask=pair)

    # The collapse, rounded to the streams' dtype, stored; its statistics; then the norm in place.
    dtype = H.dtype.element_ty
    square_sum = 0.0
    for c in range(0, CHUNKS * BLOCK, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        tile = live[:, None] & (cols[None, :] < hidden)
        h = tl.load(
            H + row * n * hidden + j[:, None] * hidden + cols[None, :], mask=tile, other=0.0
        )
        collapsed = tl.sum(pre[:, None] * h.to(tl.float32), axis=0).to(dtype).to(tl.float32)
        square_sum += tl.sum(collapsed * collapsed, axis=0)
        tl.store(X + row * hidden + cols, collapsed.to(X.dtype.element_ty), mask=cols < hidden)
    tl.debug_barrier()
    inv_rms = 1.0 / tl.sqrt(square_sum / hidden + norm_eps)
    for c in range(0, CHUNKS * BLOCK, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        x = tl.load(X + row * hidden + cols, mask=cols < hidden, other=0.0).to(tl.float32)
        w = tl.load(WEIGHT + cols, mask=cols < hidden, other=0.0).to(tl.float32)
        tl.store(
            X + row * hidden + cols, (w * (x * inv_rms)).to(X.dtype.element_ty), mask=cols < hidden
        )


def _float_streams(h: torch.Tensor) -> bool:
    """Contiguous streams [rows, n, hidden] of a float dtype."""
    floats = (torch.float16, torch.bfloat16, torch.float32)
    return h.dim() == 3 and h.dtype in floats and h.is_contiguous()


def supports(
    h: torch.Tensor,
    y: torch.Tensor | None,
    post: torch.Tensor | None,
    comb: torch.Tensor | None,
    fn: torch.Tensor,
) -> bool:
    """Contiguous streams of a float dtype, `fn` [(2 + n) n, n hidden], and the update (if any)
    as `supports_update` takes it."""
    if not _float_streams(h):
        return False
    _, n, hidden = h.shape
    if not (fn.is_contiguous() and fn.shape == ((2 + n) * n, n * hidden)):
        return False
    return y is None or supports_update(h, y, post, comb)


def supports_update(
    h: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> bool:
    """Contiguous streams [rows, n, hidden] of a float dtype, the block output [rows, hidden] in
    their dtype, post [rows, n] and comb [rows, n, n] contiguous float32."""
    if not _float_streams(h):
        return False
    rows, n, hidden = h.shape
    return (
        y.dtype == h.dtype
        and y.shape == (rows, hidden)
        and y.is_contiguous()
        and post.dtype == comb.dtype == torch.float32
        and post.shape == (rows, n)
        and comb.shape == (rows, n, n)
        and post.is_contiguous()
        and comb.is_contiguous()
    )


def rows_tiles(hidden: int) -> tuple[int, int, int, int]:
    """The block-of-rows tiles both `_mix_rows_kernel` and `_expand_kernel` take from
    ROWS_KERNEL_FROM rows: (rows a program, columns of each stream a program, a step of them,
    warps)."""
    width = triton.next_power_of_2(hidden)
    step = min(ROWS_STEP, width)
    return BLOCK_ROWS, max(step, min(ROWS_CHUNK, width)), step, ROWS_WARPS


def expand_tiles(rows: int, hidden: int) -> tuple[int, int, int, int]:
    """`_expand_kernel`'s (rows a program, columns of each stream a program, a step of them,
    warps) for `rows` x `hidden` streams: the mixing's tiles from ROWS_KERNEL_FROM rows; for
    decode batches one step a program of at least 256 elements a stream (8 a thread a warp)."""
    if rows >= ROWS_KERNEL_FROM:
        return rows_tiles(hidden)
    width = triton.next_power_of_2(hidden)
    per_program = triton.next_power_of_2(rows)
    step = min(width, max(ROWS_STEP, 256 // per_program))
    return per_program, step, step, max(1, min(4, per_program * step // 256))


def expand(
    h: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """The update alone, one launch: the streams h [rows, n, hidden] after the block output y
    [rows, hidden] with the site's post [rows, n] and comb [rows, n, n] float32 -> post y +
    comb^T h, new streams (the torch form: model/families/deepseek_v4/mhc.py's `expand`)."""
    rows, n, hidden = h.shape
    out = torch.empty_like(h)
    if rows == 0:
        return out
    per_program, block, step, warps = expand_tiles(rows, hidden)
    grid = (triton.cdiv(hidden, block), triton.cdiv(rows, per_program))
    _expand_kernel[grid](
        h,
        y,
        post,
        comb,
        out,
        rows,
        n,
        hidden,
        ROWS=per_program,
        BLOCK=block,
        STEP=step,
        N_PAD=triton.next_power_of_2(n),
        num_warps=warps,
    )
    return out


def hyper_connection(
    h: torch.Tensor,
    y: torch.Tensor | None,
    post: torch.Tensor | None,
    comb: torch.Tensor | None,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    iters: int,
    hc_eps: float,
    hc_norm_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One mHC site: h [rows, n, hidden] contiguous (and, given y [rows, hidden], the previous
    site's post [rows, n], comb [rows, n, n] float32: the update first) -> (the streams, the
    normalised collapse [rows, hidden] in h's dtype, post, comb)."""
    rows, n, hidden = h.shape
    mixes = (2 + n) * n
    n_pad, mix_pad = triton.next_power_of_2(n), triton.next_power_of_2(mixes + 1)
    # `tl.dot` takes no fewer than 16 columns: one stream's 3 mixings (n = 1) stay per row.
    by_rows = rows >= ROWS_KERNEL_FROM and mix_pad >= 16
    if by_rows:
        per_program, block, step, warps = rows_tiles(hidden)
    else:
        per_program = min(triton.next_power_of_2(max(rows, 1)), MAX_ROWS_PER_PROGRAM)
        width = triton.next_power_of_2(hidden)
        block = max(16, min(width, FN_TILE // (mix_pad * n_pad)))
        warps = 8  # the FN_TILE tile and its product with the streams (chosen, not measured)
    chunks = triton.cdiv(hidden, block)
    expand = y is not None
    out = torch.empty_like(h) if expand else h
    x = torch.empty(rows, hidden, dtype=h.dtype, device=h.device)
    post_out = torch.empty(rows, n, dtype=torch.float32, device=h.device)
    comb_out = torch.empty(rows, n, n, dtype=torch.float32, device=h.device)
    if rows == 0:
        return out, x, post_out, comb_out
    partial = torch.empty(rows, chunks, mix_pad, dtype=torch.float32, device=h.device)
    ready = (y, post, comb) if expand else (h, h, h)  # placeholders, never read
    mix_kernel = _mix_rows_kernel if by_rows else _mix_kernel
    dot = "ieee" if ROWS_DOT == "bf16x3" and h.dtype != torch.bfloat16 else ROWS_DOT
    extra = {"DOT": dot, "STEP": step} if by_rows else {}
    # Chunks first in launch order: programs that run together read adjacent columns of the same
    # rows. Measured against rows first, it changed nothing (3.62 against 3.60 ms at 8192 rows,
    # docs/benchmarks.md 2026-12-06); kept for the reads it keeps together.
    mix_kernel[(chunks, triton.cdiv(rows, per_program))](
        h,
        *ready,
        out,
        fn,
        partial,
        rows,
        n,
        hidden,
        mixes,
        EXPAND=expand,
        ROWS=per_program,
        CHUNKS=chunks,
        BLOCK=block,
        N_PAD=n_pad,
        MIX_PAD=mix_pad,
        **extra,
        num_warps=warps,
    )
    collapse_block = min(triton.next_power_of_2(hidden), COLLAPSE_BLOCK)
    _collapse_kernel[(rows,)](
        out,
        partial,
        base,
        scale,
        norm_weight,
        x,
        post_out,
        comb_out,
        n,
        hidden,
        mixes,
        hc_eps,
        hc_norm_eps,
        norm_eps,
        ITERS=iters,
        PARTS=chunks,
        PARTS_PAD=triton.next_power_of_2(chunks),
        CHUNKS=triton.cdiv(hidden, collapse_block),
        BLOCK=collapse_block,
        N_PAD=n_pad,
        MIX_PAD=mix_pad,
    )
    return out, x, post_out, comb_out
